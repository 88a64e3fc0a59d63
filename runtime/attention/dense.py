"""Dense causal attention over a packed batch, without a KV cache: each sequence's new
tokens are its whole sequence. The oracle for the paged backends and the backend for
one-shot prefill (logits parity tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.metadata import AttentionMetadata


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kwargs) -> torch.Tensor:
    """q [.., H, Lq, D], k/v [.., KV, Lk, D] -> [.., H, Lq, D]; GQA without copying K/V
    where torch can (enable_gqa)."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kwargs)


class DenseAttentionBackend:
    name = "dense"

    def forward(self, layer, q, k, v, output, attn_metadata: AttentionMetadata) -> None:
        h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        starts = attn_metadata.query_start_loc_cpu
        for s, e in zip(starts[:-1], starts[1:]):
            qs = q[s:e].reshape(e - s, h, d).transpose(0, 1)
            ks = k[s:e].reshape(e - s, kvh, d).transpose(0, 1)
            vs = v[s:e].reshape(e - s, kvh, d).transpose(0, 1)
            out = sdpa(qs, ks, vs, layer.scale, is_causal=True)
            output[s:e] = out.transpose(0, 1).reshape(e - s, h * d)
