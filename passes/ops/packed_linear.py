"""`compilecore.packed_mm(x, w)`: `x @ w.T` for 16-bit weights on CPU, on a copy of the
weight packed once for the kernel that runs it.

`torch.mm` on a bf16 CPU tensor reorders the weight into oneDNN's layout on every call:
at the batch sizes of decode (2-64 rows) that reorder costs more than the product. So the
weight is prepared once and kept as the weight's derived copy (`passes/ops/derived.py`:
made again when the weight changes, freed with it), for one of two kernels:

- `packed_mm.cpp` (bf16, AVX512-BF16 without AMX, every row count): our tiles of 16 rows
  x 16 columns on a `vdpbf16ps`-friendly layout. Over the model's GEMM shapes it ran 1.2-1.7x
  oneDNN's reordered product from 1 to 32 rows, 1.06x at 64-128, and tied it at 512
  (docs/kernel-choices.md, Packed weights for batches). Its call is declared to CPU graphs as it
  is made.
- oneDNN on its blocked layout (`_reorder_linear_weight`) everywhere else (fp16, CPUs
  without AVX512-BF16, AMX, whose tiles beat any vector kernel): inside a CPU-graph
  replay through AOTInductor's C shim (`onednn_shim`), the call the op declares.

Where torch has no native bf16 GEMM (AVX2 without AVX-512: `bf16_gemm_is_native`) bf16
products of WIDEN_ROWS rows and more run as MKL's fp32 GEMM on the weight widened into a
reused scratch a slice at a time (`widened_mm`; exact: bf16 values widen to fp32 without
rounding). Nothing is kept, so nothing can go stale; no CPU graph records it.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from passes import huge_pages, native, native_calls
from passes.native_calls import NativeCall, Unrecordable
from passes.ops import derived, onednn_shim
from passes.ops.scratch import row_slices, scratch

# Rows from which a bf16 product on a CPU without a native bf16 GEMM widens the weight
# (`widened_mm`); below, torch's generic bf16 loop, whose cost grows with the rows where
# widening costs a fixed ~1.5 ns a weight value: against it, 0.7-1.2x at 8 rows, 1.8-3.0x at
# 16, 3-4.7x at 64, 4.8-5.3x at 512 (1536 x 576 to 8192 x 2048, 2 threads of an EPYC Zen 3:
# docs/kernel-choices.md, Packed weights for batches).
WIDEN_ROWS = 16
# Rows up to which `fp32_linear` puts the weight first: 1.03-1.33x at 64 rows, 0.74-1.04x
# at 512 (1536 x 576 to 16384 x 2048, 2 threads of an EPYC Zen 3).
WEIGHT_FIRST_ROWS = 64
# The batch size oneDNN lays the weight out for: measured as fast as a per-size layout
# from 2 to 2048 rows, so one copy serves every batch.
PACK_BATCH_HINT = 2048


class _HugePageArena:
    """64-byte-aligned buffers carved from 2 MiB-aligned chunks advised MADV_HUGEPAGE. The
    packed copies are streamed as the weights are: from huge pages decode batches of 2-8 ran
    1.05-1.13x faster end to end (docs/kernel-choices.md, Huge pages). A chunk is freed when no
    buffer carved from it is left."""

    CHUNK = 32 << 20

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0
        self.lock = threading.Lock()

    def alloc(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // 64) * 64
        with self.lock:
            if self.chunk is None or self.used + size > self.chunk.numel():
                self.chunk = huge_pages.huge_page_buffer(max(self.CHUNK, size))[0]
                self.used = 0
            buffer = self.chunk[self.used : self.used + nbytes]
            self.used += size
        return buffer


_ARENA = _HugePageArena()


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bf16 products run on them)."""
    check = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else False


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    """Our kernel's library where it builds here (AVX512-BF16), else None."""
    return native.load_op_kernel(
        Path(__file__).with_name("packed_mm.cpp"), "packed_mm_available", (),
        ("packed_mm_numel(i64, i64) -> i64", "packed_mm_pack(ptr, i64 x3, ptr, i64)",
         "packed_mm_bf16(ptr, i64, ptr, ptr, ptr, i64 x5)"),
    )  # fmt: skip


@functools.cache
def bf16_gemm_is_native() -> bool:
    """Whether torch's CPU GEMM multiplies bf16 natively here (oneDNN, AVX-512 and later).
    With AVX2 alone it is a generic dot loop (`bf16_dot_with_fp32_arith`): a 512-token
    prefill of the default model ran at 70-75 tok/s, where MKL's fp32 GEMM on fp32 values
    gives it ~4x (benchmarks/bench_gguf.py, pp512)."""
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


def widens(dtype: torch.dtype) -> bool:
    """Whether bf16 products run as fp32 GEMMs on a widened copy (`widened_mm`): bf16
    where torch's bf16 GEMM is not native (AVX2 without AVX-512: `bf16_gemm_is_native`,
    cached, as every batched product asks)."""
    return dtype == torch.bfloat16 and not bf16_gemm_is_native()


def uses_own_kernel(dtype: torch.dtype) -> bool:
    """Whether products with this weight dtype run `packed_mm.cpp` (else oneDNN): bf16
    with AVX512-BF16 and no AMX. On an AMX Xeon oneDNN's tiles ran the model's products at 16
    rows 5.5x faster than our vector loop, and from 2 rows on faster (docs/kernel-choices.md,
    Packed weights for batches)."""
    return dtype == torch.bfloat16 and not has_amx() and _kernel() is not None


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The 16-bit dtypes the op runs natively on this CPU: bf16 with AVX512-BF16 (our
    kernel or oneDNN) or AMX, fp16 with oneDNN on AVX512-FP16 or AVX-NE-CONVERT."""
    mkldnn = torch.ops.mkldnn
    onednn = torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
    checks = ((torch.bfloat16, "_is_mkldnn_bf16_supported"),
              (torch.float16, "_is_mkldnn_fp16_supported"))  # fmt: skip
    return tuple(
        d for d, name in checks
        if uses_own_kernel(d) or widens(d)
        or (onednn and hasattr(mkldnn, name) and getattr(mkldnn, name)())
    )  # fmt: skip


def available() -> bool:
    return bool(supported_dtypes())


def _prepare(w: torch.Tensor) -> torch.Tensor:
    if not uses_own_kernel(w.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
    lib, (n, k) = _kernel(), w.shape
    w = w if w.stride(1) == 1 else w.contiguous()
    numel = lib.packed_mm_numel(n, k)
    packed = _ARENA.alloc(numel * w.element_size()).view(w.dtype)
    lib.packed_mm_pack(w.data_ptr(), w.stride(0), n, k, packed.data_ptr(),
                       torch.get_num_threads())  # fmt: skip
    return packed


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """The prepared copy of `w` ([N, K]) for whichever kernel runs it (made once, made
    again when w changes: passes/ops/derived.py)."""
    return derived.derived(w, "packed_mm", _prepare)


def _own_kernel_call(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
) -> NativeCall:
    lib, (m, k), n = _kernel(), x.shape, w.shape[0]
    b = 0 if bias is None else bias
    args = (x, x.stride(0), packed_weight(w), b, y, n, m, n, k, torch.get_num_threads())
    fn = lib.packed_mm_bf16
    return NativeCall(native_calls.function_address(fn), args, "compilecore.packed_mm", 0, fn)


def _native_call(args: tuple, out: torch.Tensor) -> NativeCall | tuple:
    """The C call `packed_mm` makes: our kernel, or oneDNN's linear through AOTInductor's C
    shim (the op itself calls oneDNN through torch; the shim runs the same product)."""
    x, w, bias = (*args, None)[:3]
    if x.dtype == w.dtype and widens(w.dtype):
        raise Unrecordable("compilecore.packed_mm without a native bf16 GEMM (torch's own)")
    own = x.dtype == w.dtype and uses_own_kernel(w.dtype)
    # The kernel reads x's rows at any stride, oneDNN only a contiguous x; copies made per
    # call would be replayed as the one made at capture.
    if x.stride(1) != 1 or not (own or x.is_contiguous()):
        raise Unrecordable("compilecore.packed_mm on an input its kernel cannot read in place")
    if bias is not None and not bias.is_contiguous():
        raise Unrecordable("compilecore.packed_mm with a strided bias")
    if not x.shape[0]:
        return ()
    if own:
        return _own_kernel_call(x, w, bias, out)
    call = onednn_shim.linear_call(x, packed_weight(w), bias, out)
    if call is None:
        raise Unrecordable("compilecore.packed_mm through oneDNN (no AOTInductor shim)")
    return call


def packed_mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias): the bias added in fp32 before the one rounding, as addmm does."""
    if x.dtype == w.dtype and widens(w.dtype):
        return widened_mm(x, w, bias)
    if x.dtype == w.dtype and uses_own_kernel(w.dtype):
        x = x if x.stride(1) == 1 else x.contiguous()
        bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
        if x.shape[0]:
            _own_kernel_call(x, w, bias, y).run()
        return y
    x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), bias, "none", [], "")


def widened_mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T (+ bias) in fp32 on w widened into this thread's scratch a slice of rows at
    a time, rounded once to x's dtype; fewer than WIDEN_ROWS rows: torch's own product."""
    if x.shape[0] < WIDEN_ROWS:
        return torch.nn.functional.linear(x, w, bias)
    x32, bias32 = x.float(), None if bias is None else bias.float()
    y = x.new_empty(x.shape[0], w.shape[0])
    for a, b in row_slices(w.shape[0], w.shape[1] * 4):
        part = scratch((b - a, w.shape[1]), torch.float32).copy_(w[a:b])
        fp32_linear(x32, part, None if bias32 is None else bias32[a:b], y[:, a:b])
    return y


def fp32_linear(x, w, bias, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w^T (+ bias) on fp32 operands; `out` may be a column slice of a wider
    result, in any dtype (the one rounding). Up to WEIGHT_FIRST_ROWS rows as (w @ x^T)^T:
    MKL's GEMM packs its second operand every call, which at 16 rows took 1.35-1.66x the
    time when that was the weight; at 512 rows weight first lost up to 0.74x
    (docs/kernel-choices.md, Packed weights for batches)."""
    if x.shape[0] > WEIGHT_FIRST_ROWS:
        return out.copy_(torch.nn.functional.linear(x, w, bias))
    xt = x.t()
    yt = torch.mm(w, xt) if bias is None else torch.addmm(bias.unsqueeze(1), w, xt)
    return out.copy_(yt.t())


def _fake_packed_mm(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


# Registered through `torch.library.Library`, not the `custom_op` decorator, whose Python
# wrapper costs ~8 us a call (docs/kernel-choices.md, Library registration): a batched decode
# step makes 121 of them.
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("packed_mm(Tensor x, Tensor w, Tensor? bias=None) -> Tensor")
_LIB.impl("packed_mm", packed_mm, "CPU")
torch.library.register_fake("compilecore::packed_mm", _fake_packed_mm, lib=_LIB)
native_calls.declare_entry("compilecore::packed_mm", _native_call)
