"""QKV split + RoPE on q and k -> `compilecore.fused_qkv_rope`.

Unfused (what `LlamaAttention` traces to between the QKV GEMM and attention):

    q, k, v  = split_with_sizes(qkv, [H*D, KV*D, KV*D], -1)
    cos, sin = split(unsqueeze(convert(index(cos_sin_cache, [positions])), 1), D/2, -1)
    q1, q2   = split(reshape(q, [-1, H, D]), D/2, -1)
    q        = reshape(cat([q1*cos - q2*sin, q2*cos + q1*sin], -1), [-1, H*D])
    k        = (the same with KV heads)

Fused (one pass over the QKV output; v is copied out too):

    q, k, v = compilecore.fused_qkv_rope(qkv, positions, cos_sin_cache, H, KV, D)

The head counts and head size are part of the pattern, so it is registered for each
attention shape of the model (per tensor-parallel rank). One site per decoder layer: L.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import AttentionShapePatternPass, dtype_check, trace_pattern
from passes.config import AttentionShape
from passes.ops.qkv_rope import apply_rope, rope_cos_sin


def _make(shape: AttentionShape):
    h, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim

    def search(qkv, positions, cos_sin_cache):
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        cos, sin = rope_cos_sin(cos_sin_cache, positions, qkv.dtype)
        return apply_rope(q, cos, sin, d), apply_rope(k, cos, sin, d), v

    def replace(qkv, positions, cos_sin_cache):
        out = torch.ops.compilecore.fused_qkv_rope.default(qkv, positions, cos_sin_cache, h, kv, d)
        return out[0], out[1], out[2]

    return search, replace


class QKVRoPEFusionPass(AttentionShapePatternPass):
    name = "fuse_qkv_rope"
    depends_on = ("passes.ops.qkv_rope",)

    def register(self) -> None:
        for shape in self.shapes:
            search, replace = _make(shape)
            width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
            for dtype in self.pattern_dtypes():
                qkv = torch.empty(4, width, dtype=dtype)
                positions = torch.zeros(4, dtype=torch.long)
                cache = torch.empty(16, shape.head_dim, dtype=torch.float32)
                register_replacement(
                    search,
                    replace,
                    [qkv, positions, cache],
                    trace_pattern,
                    self.patterns,
                    extra_check=dtype_check("qkv", self.dtypes),
                )
