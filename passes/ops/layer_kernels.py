"""The CPU kernels of the batch-1 layer ops (`layer_kernels.cpp`): how each op's call is
made, as data (`passes.native_calls.NativeCall`), from its arguments and outputs.

Each builder returns None where the kernel does not apply (not bf16, not contiguous, no
AVX-512, no compiler); the op then runs its torch reference. The op runs the call in a
region of its own; a CPU graph records the same call as a team function
(`passes.native_calls.declare_entry`), so a piece's ops and the attention between pieces run in
one OpenMP team at replay, a barrier between calls (compilecore/cpu_graph.py)."""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path

import torch

from passes import native, native_calls
from passes.native_calls import NativeCall


@functools.cache
def _kernel(dot_sizes: tuple[int, ...] = ()) -> ctypes.CDLL | None:
    """`layer_kernels.cpp` built for this CPU, its products unrolled for `dot_sizes`."""
    # Every argument travels as an int64 (pointers too), the team size last.
    return native.load_op_kernel(
        Path(__file__).with_name("layer_kernels.cpp"), "layer_kernels_available", dot_sizes,
        ("linear_bf16(i64 x7)", "add_rms_norm_bf16(i64 x9)", "silu_and_mul_bf16(i64 x5)",
         "qkv_rope_bf16(i64 x13)"),
    )  # fmt: skip


def available() -> bool:
    """Whether the layer ops run their C kernels here (a C compiler and AVX-512)."""
    return _kernel() is not None


def _bf16_contiguous(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None or (t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous())
        for t in tensors
    )


def _call(lib: ctypes.CDLL, name: str, args: tuple, what: str) -> NativeCall:
    team = getattr(lib, f"{name}_team_bf16")
    eager = getattr(lib, f"{name}_bf16")
    return NativeCall(
        native_calls.function_address(team), args, what, torch.get_num_threads(), eager
    )


def _null(t: torch.Tensor | None) -> torch.Tensor | int:
    return 0 if t is None else t


def linear_call(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
) -> NativeCall | None:
    """y [1, N] = x [1, K] @ w [N, K]^T (+ bias), bf16, one row."""
    if x.dim() != 2 or x.shape[0] != 1 or not _bf16_contiguous(x, w, bias, y):
        return None
    lib = _kernel(native.unrolled_sizes(x.shape[1]))
    if lib is None:
        return None
    args = (x, w, _null(bias), y, w.shape[0], w.shape[1])
    return _call(lib, "linear", args, "compilecore.linear")


def _eps_bits(eps: float) -> int:
    return struct.unpack("<I", struct.pack("<f", eps))[0]


def add_rms_norm_call(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor, residual_out: torch.Tensor,
) -> NativeCall | None:  # fmt: skip
    if not _bf16_contiguous(x, residual, weight, out, residual_out) or (lib := _kernel()) is None:
        return None
    hidden = x.shape[-1]
    args = (x, residual, weight, out, residual_out, x.numel() // max(hidden, 1), hidden)
    return _call(lib, "add_rms_norm", (*args, _eps_bits(eps)), "compilecore.fused_add_rms_norm")


def silu_and_mul_call(x: torch.Tensor, out: torch.Tensor) -> NativeCall | None:
    if x.dim() != 2 or not _bf16_contiguous(x, out) or (lib := _kernel()) is None:
        return None
    args = (x, out, x.shape[0], x.shape[1] // 2)
    return _call(lib, "silu_and_mul", args, "compilecore.silu_and_mul")


def qkv_rope_call(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int, int],
) -> NativeCall | None:  # fmt: skip
    """q, k, v from qkv [M, (H + 2 KV) D] (rows may be strided), rotated by the positions'
    rows of an fp32 cos/sin cache; None where a converted copy of an input would be needed
    (a recorded call must read the caller's own buffers)."""
    if (
        qkv.dim() != 2
        or qkv.stride(-1) != 1
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
        or not _bf16_contiguous(q, k, v)
        or qkv.dtype != torch.bfloat16
        or (lib := _kernel()) is None
    ):
        return None
    h, kv, d = heads
    args = (qkv, qkv.stride(0), positions, cos_sin_cache, q, k, v, qkv.shape[0], h, kv, d)
    return _call(lib, "qkv_rope", (*args, cos_sin_cache.shape[-1]), "compilecore.fused_qkv_rope")
