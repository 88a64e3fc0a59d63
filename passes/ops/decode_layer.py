"""`decode_layer(attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv, positions,
cos_sin_cache, eps, num_heads, num_kv_heads, head_dim) -> (q, k, v, residual_out)`: one
decoder layer's piece between two attentions at batch 1 (o_proj, residual add, RMSNorm,
gate_up, SiLU-and-mul, down, residual add, the next layer's RMSNorm, QKV, RoPE), as one
parallel region of our own C loops (`decode_layer.cpp`; benchmarks/NOTES.md, section 31).

`decode_layer_ref` is the same math in torch, op by op as the model computes it: what the
pass (passes/fuse_decode_layer.py) looks for, and what the op runs where the C kernel
does not apply (not bf16, not one row, no AVX-512)."""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path

import torch
import torch.nn.functional as F

from passes import native
from passes.ops.add_rms_norm import fused_add_rms_norm_ref
from passes.ops.qkv_rope import apply_rope, rope_cos_sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]`: the merged gate/up projection's activation."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def decode_layer_ref(
    attn: torch.Tensor,
    residual: torch.Tensor,
    w_o: torch.Tensor,
    w_post: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_in: torch.Tensor,
    w_qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.mm(attn, w_o.permute(1, 0))
    x, s = fused_add_rms_norm_ref(h, residual, w_post, eps)
    m = silu_and_mul(torch.mm(x, w_gate_up.permute(1, 0)))
    d = torch.mm(m, w_down.permute(1, 0))
    x, s = fused_add_rms_norm_ref(d, s, w_in, eps)
    qkv = torch.mm(x, w_qkv.permute(1, 0))
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = rope_cos_sin(cos_sin_cache, positions, qkv.dtype)
    return apply_rope(q, cos, sin, head_dim), apply_rope(k, cos, sin, head_dim), v, s


@functools.cache
def _kernel(dot_sizes: tuple[int, ...] = ()) -> ctypes.CDLL | None:
    """`decode_layer.cpp` built for this CPU, its products unrolled for `dot_sizes`."""
    source = Path(__file__).with_name("decode_layer.cpp")
    lib = native.load_op_kernel(source, "decode_layer_available", dot_sizes)
    if lib is None:
        return None
    lib.decode_layer_bf16.argtypes = [ctypes.c_void_p] * 15 + [ctypes.c_int64] * 8
    lib.decode_layer_bf16.restype = None
    lib.decode_layer_scratch.argtypes = [ctypes.c_int64] * 4
    lib.decode_layer_scratch.restype = ctypes.c_int64
    lib.decode_layer_unrolled.argtypes = [ctypes.c_int64]
    lib.decode_layer_unrolled.restype = ctypes.c_int64
    return lib


def kernel_available() -> bool:
    """Whether `compilecore.decode_layer` runs the C kernel here (bf16, AVX-512)."""
    return _kernel() is not None


def _kernel_applies(tensors: list[torch.Tensor], rotary_dim: int, head_dim: int) -> bool:
    return (
        tensors[0].shape[0] == 1
        and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors[:8])
        and rotary_dim == head_dim
        and kernel_available()
    )


def decode_layer(
    attn: torch.Tensor,
    residual: torch.Tensor,
    w_o: torch.Tensor,
    w_post: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_in: torch.Tensor,
    w_qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    weights = [attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv]
    rotary_dim = cos_sin_cache.shape[-1]
    if not _kernel_applies(weights, rotary_dim, head_dim):
        native.refuse("compilecore.decode_layer outside its C kernel's cases")
        shape = (eps, num_heads, num_kv_heads, head_dim)
        q, k, v, s = decode_layer_ref(*weights, positions, cos_sin_cache, *shape)
        return q, k, v.contiguous(), s
    hidden, q_size, kv_size = residual.shape[-1], num_heads * head_dim, num_kv_heads * head_dim
    inter = w_down.shape[-1]
    lib = _kernel(native.unrolled_sizes(q_size, hidden, inter)) or _kernel()
    threads = torch.get_num_threads()
    new = functools.partial(torch.empty, dtype=torch.bfloat16)
    q, k, v, s = new(1, q_size), new(1, kv_size), new(1, kv_size), new(1, hidden)
    scratch = torch.empty(lib.decode_layer_scratch(hidden, q_size, inter, threads))
    eps_bits = struct.unpack("<I", struct.pack("<f", eps))[0]
    cos_sin = cos_sin_cache.float().contiguous()
    position = positions.to(torch.int64).contiguous()
    args = (*weights, cos_sin, position, q, k, v, s, scratch)
    args += (hidden, q_size, kv_size, inter, head_dim, rotary_dim, eps_bits, threads)
    lib.decode_layer_bf16(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))
    if native.is_capturing():  # a CPU graph replays this call on the same buffers
        if cos_sin is not cos_sin_cache or position is not positions:
            native.refuse("compilecore.decode_layer on a converted cos/sin cache or positions")
        # As a team function: the replay runs the layers and the attention between them
        # in one OpenMP team, no region opened and closed per call.
        address = native.function_address(lib.decode_layer_team_bf16)
        native.record_native_call(address, args, "compilecore.decode_layer", team=threads)
    return q, k, v, s


def _fake_decode_layer(
    attn,
    residual,
    w_o,
    w_post,
    w_gate_up,
    w_down,
    w_in,
    w_qkv,
    positions,
    cos_sin_cache,
    eps,
    num_heads,
    num_kv_heads,
    head_dim,
):
    rows = attn.shape[0]
    return (
        attn.new_empty(rows, num_heads * head_dim),
        attn.new_empty(rows, num_kv_heads * head_dim),
        attn.new_empty(rows, num_kv_heads * head_dim),
        residual.new_empty(residual.shape),
    )


# Through `torch.library.Library`, not the `custom_op` decorator, whose Python wrapper
# costs ~8 us a call (NOTES section 9).
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define(
    "decode_layer(Tensor attn, Tensor residual, Tensor w_o, Tensor w_post, Tensor w_gate_up, "
    "Tensor w_down, Tensor w_in, Tensor w_qkv, Tensor positions, Tensor cos_sin_cache, "
    "float eps, int num_heads, int num_kv_heads, int head_dim) -> (Tensor, Tensor, Tensor, Tensor)"
)
_LIB.impl("decode_layer", decode_layer, "CPU")
torch.library.register_fake("compilecore::decode_layer", _fake_decode_layer, lib=_LIB)
