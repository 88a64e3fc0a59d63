"""`fused_qkv_rope(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim)
-> (q, k, v)`: one pass over the QKV projection output that splits it and rotates q and
k (neox-style rotary embedding over the whole head).

`rope_cos_sin` and `apply_rope` are the math the model itself uses, so the pattern the
pass looks for is exactly what the model computes."""

from __future__ import annotations

import torch

from passes import native_calls
from passes.native_calls import NativeCall
from passes.ops import layer_kernels
from passes.ops.triton_utils import next_power_of_2, use_triton


def rope_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, rotary_dim / 2] for each position, in the activation dtype."""
    cos, sin = cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int
) -> torch.Tensor:
    """Rotate [T, heads * head_size] by (cos, sin); dims past 2 * cos.shape[-1] pass."""
    width = x.shape[-1]
    x = x.reshape(-1, width // head_size, head_size)  # static sizes: no symbolic reshape
    rotary_dim = 2 * cos.shape[-1]
    # No slice when the whole head rotates, so the traced graph has no no-op to match.
    x1, x2 = (x if rotary_dim == head_size else x[..., :rotary_dim]).chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if rotary_dim < head_size:
        rotated = torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    return rotated.reshape(-1, width)


def fused_qkv_rope_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = rope_cos_sin(cos_sin_cache, positions, qkv.dtype)
    return apply_rope(q, cos, sin, head_dim), apply_rope(k, cos, sin, head_dim), v.clone()


def _get_kernel():
    from passes.ops.triton_fused import qkv_rope_kernel

    return qkv_rope_kernel


def fused_qkv_rope_triton(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim):
    tokens = qkv.shape[0]
    q = qkv.new_empty(tokens, num_heads * head_dim)
    k = qkv.new_empty(tokens, num_kv_heads * head_dim)
    v = qkv.new_empty(tokens, num_kv_heads * head_dim)
    if tokens:
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        grid = (tokens, num_heads + 2 * num_kv_heads)
        _get_kernel()[grid](
            qkv,
            positions,
            cos_sin_cache,
            q,
            k,
            v,
            qkv.stride(0),
            cos_sin_cache.stride(0),
            NUM_HEADS=num_heads,
            NUM_KV=num_kv_heads,
            HEAD=head_dim,
            HALF_BLOCK=next_power_of_2(head_dim // 2),
        )
    return q, k, v


def fused_qkv_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(qkv):
        return fused_qkv_rope_triton(
            qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim
        )
    args = (qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim)
    outs = _empty_outputs(qkv, num_heads, num_kv_heads, head_dim)
    call = _native_call(args, outs) if qkv.device.type == "cpu" else None
    if call is None:
        return fused_qkv_rope_ref(*args)
    call.run()
    return outs


def _empty_outputs(qkv, num_heads, num_kv_heads, head_dim):
    tokens = qkv.shape[0]
    return (
        qkv.new_empty(tokens, num_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
    )


def _native_call(args: tuple, outs: tuple) -> NativeCall | None:
    """Our C loop (`layer_kernels.cpp`) for bf16 on CPU, whole heads rotated; None elsewhere."""
    qkv, positions, cache, h, kv, d = args
    return layer_kernels.qkv_rope_call(qkv, positions, cache, *outs, (h, kv, d))


_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define(
    "fused_qkv_rope(Tensor qkv, Tensor positions, Tensor cos_sin_cache, int num_heads, "
    "int num_kv_heads, int head_dim) -> (Tensor, Tensor, Tensor)"
)
for _key in ("CPU", "CUDA"):
    _LIB.impl("fused_qkv_rope", fused_qkv_rope, _key)
torch.library.register_fake(
    "compilecore::fused_qkv_rope",
    lambda qkv, positions, cache, h, kv, d: _empty_outputs(qkv, h, kv, d),
    lib=_LIB,
)
native_calls.declare_entry("compilecore::fused_qkv_rope", _native_call)
