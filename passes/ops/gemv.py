"""Small-batch linear layers on CPU: as a multiply and a reduction over K that Inductor
generates as one vectorized loop (see passes/gemv_to_reduction.py), and the LM head's
product as our own C loop (`compilecore.gemv_logits`, `gemv.cpp`) where the CPU has
AVX512-BF16."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from passes import native


def gemv_reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T for small M."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1).to(x.dtype)


def gemv_logits_reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The LM head's small-batch GEMV, logits kept in fp32: the sampler works in fp32
    anyway, and rounding to bf16 first only makes near-ties between tokens exact ties."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1)


@functools.cache
def _kernel(dot_sizes: tuple[int, ...] = ()) -> ctypes.CDLL | None:
    """`gemv.cpp` built for this CPU (rows unrolled for `dot_sizes`), or None where it has
    no AVX512-BF16."""
    source = Path(__file__).with_name("gemv.cpp")
    lib = native.load_op_kernel(source, "gemv_available", dot_sizes)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemv_bf16_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64]
    lib.gemv_bf16_f32.restype = None
    lib.gemv_unrolled.argtypes, lib.gemv_unrolled.restype = [i64], i64
    return lib


def own_kernel_available(dtype: torch.dtype) -> bool:
    """Whether `compilecore.gemv_logits` runs our C loop for weights of this dtype."""
    return dtype == torch.bfloat16 and _kernel() is not None


def gemv_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 logits [M, N] = x [M, K] @ w [N, K]^T for bf16 x and w on CPU, read one
    weight row at a time (each x row re-reads the weight: meant for M = 1)."""
    if not (x.dtype == w.dtype and own_kernel_available(w.dtype)):
        raise RuntimeError(
            f"compilecore.gemv_logits needs bf16 x and w on a CPU with AVX512-BF16 (got "
            f"{x.dtype} and {w.dtype}); use passes.ops.gemv.gemv_logits_reduction instead"
        )
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        # A copy inside the op is invisible to a capture: the graph would replay on it.
        native.refuse("compilecore.gemv_logits on an input with strided columns")
        x, w = x.contiguous(), w.contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    if m:
        lib = _kernel(native.unrolled_sizes(k)) or _kernel()
        args = (x, x.stride(0), w, w.stride(0), y, m, n, k, torch.get_num_threads())
        lib.gemv_bf16_f32(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))
        if native.is_capturing():  # a CPU graph replays this call on the same buffers
            address = native.function_address(lib.gemv_bf16_f32)
            native.record_native_call(address, args, "compilecore.gemv_logits")
    return y


def _fake_gemv_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


# Through `torch.library.Library`, not the `custom_op` decorator, whose Python wrapper
# costs ~8 us a call (NOTES section 9).
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("gemv_logits(Tensor x, Tensor w) -> Tensor")
_LIB.impl("gemv_logits", gemv_logits, "CPU")
torch.library.register_fake("compilecore::gemv_logits", _fake_gemv_logits, lib=_LIB)
