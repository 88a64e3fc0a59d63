"""`compilecore.onednn_mm(x, w)`: `x @ w.T` through oneDNN with the weight reordered once
into oneDNN's blocked layout (CPU, 16-bit weights).

`torch.mm` on a bf16 CPU tensor reorders the weight on every call: at the batch sizes of
batched decode (2-64 rows) that reorder costs more than the product. Reordered once and
kept, the same oneDNN product streams the weight at close to memory bandwidth
(benchmarks/NOTES.md, section 23). The reordered copy lives in a table keyed by the
weight tensor itself and is made again when the weight's storage or version changes
(a reload, an in-place copy); it is freed with the weight.

Up to `SMALL_M_ROWS` rows (decode batches of 2-8; batch 1 has its own reduction loop in
the static-size code) the op runs `small_m_mm.cpp` instead: each weight row read once, in
order, for every row of x, which streamed the model's weights at 23-26 GB/s where the
reordered oneDNN product reached 17-20 at 2-4 rows and tied it at 8 (section 23). Its call
is recorded into CPU graphs, which oneDNN's cannot be, so decode batches of 2-8 replay
without Python (section 26). Without AVX512-BF16 it is not built and oneDNN takes every
size.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path

import torch

from passes import native

# The batch size oneDNN lays the weight out for: measured as fast as a per-size layout
# from 2 to 2048 rows (section 23), so one copy serves every batch.
PACK_BATCH_HINT = 2048
# id(weight) -> (weak reference to it, (data_ptr, version), its reordered copy)
_PACKED: dict[int, tuple] = {}
# Measured: the row-streaming kernel wins at 2-4 rows and ties oneDNN at 8; recorded
# into CPU graphs it wins at 5-8 too (1.1-1.4x end to end, NOTES section 26).
SMALL_M_ROWS = 8


@functools.cache
def _small_m_kernel() -> ctypes._CFuncPtr | None:
    try:
        source = Path(__file__).with_name("small_m_mm.cpp").read_text()
        lib = native.load_library(source, "small_m_mm", native.cache_root() / "torch_compile")
    except native.KernelBuildError:
        return None
    if lib.small_m_max_rows() < SMALL_M_ROWS:
        return None
    fn = lib.small_m_mm_bf16
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64]
    fn.restype = None
    return fn


def _small_m_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """The row-streaming kernel's product, or None when it does not apply here."""
    m, k = x.shape
    if m > SMALL_M_ROWS or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return None
    if x.stride(1) != 1 or w.stride(1) != 1 or (fn := _small_m_kernel()) is None:
        return None
    y = torch.empty((m, w.shape[0]), dtype=x.dtype)
    if m:
        args = (x, x.stride(0), w, w.stride(0), y, y.stride(0), m, w.shape[0], k,
                torch.get_num_threads())  # fmt: skip
        fn(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))
        # A CPU graph replays this call on the same buffers (x and y stay alive in it).
        native.record_native_call(native.function_address(fn), args, "compilecore.onednn_mm")
    return y


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The 16-bit dtypes oneDNN runs natively on this CPU (bf16 needs AVX512-BF16 or AMX,
    fp16 AVX512-FP16 or AVX-NE-CONVERT); empty without oneDNN."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")):
        return ()
    checks = ((torch.bfloat16, "_is_mkldnn_bf16_supported"),
              (torch.float16, "_is_mkldnn_fp16_supported"))  # fmt: skip
    return tuple(d for d, name in checks if hasattr(mkldnn, name) and getattr(mkldnn, name)())


def available() -> bool:
    return bool(supported_dtypes())


def _version(w: torch.Tensor) -> int:
    try:
        return w._version
    except RuntimeError:  # an inference tensor: no version counter, never modified in place
        return 0


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    # A plain dict keyed by id (checked against a weak reference) is ~4x cheaper to look
    # up than a WeakIdKeyDictionary, and a batched step looks up 121 weights.
    ident = id(w)
    entry = _PACKED.get(ident)
    key = (w.data_ptr(), _version(w))
    if entry is None or entry[0]() is not w or entry[1] != key:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        entry = (weakref.ref(w, lambda _, ident=ident: _PACKED.pop(ident, None)), key, packed)
        _PACKED[ident] = entry
    return entry[2]


def onednn_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    small = _small_m_mm(x, w)
    if small is not None:
        return small
    native.refuse("compilecore.onednn_mm through oneDNN (its calls cannot be recorded)")
    x = x if x.is_contiguous() else x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), None, "none", [], "")


def _fake_onednn_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


# Registered through `torch.library.Library`, not the `custom_op` decorator, whose Python
# wrapper costs ~8 us a call (NOTES section 9): a batched decode step makes 121 of them.
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("onednn_mm(Tensor x, Tensor w) -> Tensor")
_LIB.impl("onednn_mm", onednn_mm, "CPU")
torch.library.register_fake("compilecore::onednn_mm", _fake_onednn_mm, lib=_LIB)
