"""Paged attention in torch: the CPU backend and the oracle for the Triton kernel.

New K/V rows go into the cache by slot mapping; each query then attends over its
sequence's cached prefix plus the causal part of the new tokens. Decode rows (one new
token each) run as one batched call; prefill chunks run per sequence.
"""

from __future__ import annotations

import torch

from runtime.attention.dense import sdpa
from runtime.attention.metadata import AttentionMetadata


def write_kv_cache(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_cache [2, num_blocks, block_size, kv_heads, head_size]; slots of -1 write nothing."""
    _, nb, bs, kvh, d = kv_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kv_cache[0].view(nb * bs, kvh, d)[slots] = k.reshape(-1, kvh, d)[valid]
    kv_cache[1].view(nb * bs, kvh, d)[slots] = v.reshape(-1, kvh, d)[valid]


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_tokens` K and V rows of sequences given by block tables [..., n_blocks]
    -> [..., kv_heads, num_tokens, head_size]."""
    _, _, bs, kvh, d = kv_cache.shape
    n_blocks = -(-num_tokens // bs)
    table = block_table[..., :n_blocks].long()
    lead = table.shape[:-1]
    k = kv_cache[0][table].reshape(*lead, n_blocks * bs, kvh, d)[..., :num_tokens, :, :]
    v = kv_cache[1][table].reshape(*lead, n_blocks * bs, kvh, d)[..., :num_tokens, :, :]
    return k.transpose(-3, -2), v.transpose(-3, -2)


class TorchPagedAttentionBackend:
    name = "torch"

    def forward(self, layer, q, k, v, output, attn_metadata: AttentionMetadata) -> None:
        meta = attn_metadata
        if meta is None:  # a profiling or tracing run with no real batch
            output.zero_()
            return
        kv_cache = layer.kv_cache
        h, d = layer.num_heads, layer.head_size
        n = meta.num_actual_tokens
        write_kv_cache(kv_cache, k[:n], v[:n], meta.slot_mapping[:n])
        nd = meta.num_decodes
        if nd:
            self._decode(layer, q[:nd], output, meta, kv_cache)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(nd, meta.num_seqs):
            s, e, seq_len = starts[i], starts[i + 1], lens[i]
            ks, vs = gather_kv(kv_cache, meta.block_table[i], seq_len)
            qs = q[s:e].reshape(e - s, h, d).transpose(0, 1)
            # Query j (of q_len new tokens) sits at position seq_len - q_len + j.
            q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            out = sdpa(qs, ks, vs, layer.scale, attn_mask=mask)
            output[s:e] = out.transpose(0, 1).reshape(e - s, h * d)

    def _decode(self, layer, q, output, meta: AttentionMetadata, kv_cache) -> None:
        nd, h, d = q.shape[0], layer.num_heads, layer.head_size
        max_len = max(meta.seq_lens_cpu[:nd])
        ks, vs = gather_kv(kv_cache, meta.block_table[:nd], max_len)  # [nd, KV, L, D]
        mask = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:nd, None]
        out = sdpa(q.reshape(nd, h, 1, d), ks, vs, layer.scale, attn_mask=mask[:, None, None, :])
        output[:nd] = out.reshape(nd, h * d)
