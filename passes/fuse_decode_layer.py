"""A decoder layer's batch-1 piece between two attentions -> `compilecore.decode_layer`.

Unfused (a middle piece of a Llama-style model at one token, as the split graph holds it):

    h        = mm(attn, permute(w_o))
    s        = add(h, residual);     x = rms_norm(s) * w_post
    gu       = mm(x, permute(w_gate_up))
    m        = silu(slice(gu, :I)) * slice(gu, I:)
    d        = mm(m, permute(w_down))
    s2       = add(d, s);            x2 = rms_norm(s2) * w_in
    qkv      = mm(x2, permute(w_qkv))
    q, k, v  = split(qkv);           q, k = rope(q, k, cos_sin_cache[positions])

Fused (one parallel region, four barriers, our C loops; NOTES section 31):

    q, k, v, s2 = compilecore.decode_layer(attn, residual, w_o, w_post, w_gate_up,
                                           w_down, w_in, w_qkv, positions,
                                           cos_sin_cache, eps, H, KV, D)

Only pieces compiled for one token (the static size-1 code), bf16, RoPE over whole heads,
where the C kernel builds (AVX-512). In a Llama with L layers: L - 1 sites (the first
piece starts at the embedding, the last ends at the final norm). Registered per attention
shape, like `fuse_qkv_rope`; a match whose projections do not have that shape is left
alone.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import AttentionShapePatternPass, trace_pattern
from passes.config import AttentionShape
from passes.ops.decode_layer import decode_layer_ref

_EPS_PLACEHOLDER = 1.2345e-7  # a value no real pattern constant has


def _make(shape: AttentionShape):
    h, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim

    def search(attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv, positions, cache, eps):
        args = (attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv, positions, cache)
        return decode_layer_ref(*args, eps, h, kv, d)

    def replace(attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv, positions, cache, eps):
        args = (attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv, positions, cache)
        out = torch.ops.compilecore.decode_layer.default(*args, eps, h, kv, d)
        return out[0], out[1], out[2], out[3]

    def applies(match) -> bool:
        def shape_of(name):
            value = match.kwargs[name].meta.get("val")
            return tuple(value.shape) if isinstance(value, torch.Tensor) else None

        attn, w_qkv, cache = shape_of("attn"), shape_of("w_qkv"), shape_of("cache")
        sizes = (attn, w_qkv, cache)
        if None in sizes or not all(isinstance(n, int) for size in sizes for n in size):
            return False  # the symbolic-size code: sizes are symbols, never compared
        value = match.kwargs["attn"].meta["val"]
        return (
            attn[0] == 1
            and attn[1] == h * d
            and w_qkv[0] == (h + 2 * kv) * d
            and cache[-1] == d  # the kernel rotates whole heads
            and value.dtype == torch.bfloat16
        )

    return search, replace, applies


class DecodeLayerFusionPass(AttentionShapePatternPass):
    name = "fuse_decode_layer"
    depends_on = ("passes.ops.decode_layer",)

    def register(self) -> None:
        for shape in self.shapes:
            search, replace, applies = _make(shape)
            hidden, inter = 32, 48  # any sizes: the matcher ignores them
            width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
            q_size = shape.num_heads * shape.head_dim
            bf16 = dict(dtype=torch.bfloat16)
            example = [
                torch.empty(1, q_size, **bf16),
                torch.empty(1, hidden, **bf16),
                torch.empty(hidden, q_size, **bf16),
                torch.empty(hidden, **bf16),
                torch.empty(2 * inter, hidden, **bf16),
                torch.empty(hidden, inter, **bf16),
                torch.empty(hidden, **bf16),
                torch.empty(width, hidden, **bf16),
                torch.zeros(1, dtype=torch.long),
                torch.empty(16, shape.head_dim, dtype=torch.float32),
            ]
            register_replacement(
                search,
                replace,
                example,
                trace_pattern,
                self.patterns,
                extra_check=applies,
                scalar_workaround={"eps": _EPS_PLACEHOLDER},
            )
