"""Library products as C calls a CPU graph can record, through the entry points
AOTInductor's generated code uses, exported by libtorch_cpu as plain C:
`aoti_torch_cpu__linear_pointwise` (oneDNN's linear) and `aoti_torch_mm_out`.

Small C functions call them on tensor handles (heap `at::Tensor`s made once at capture).
`onednn_linear_into` copies the result's bytes into the output buffer the graph keeps: the
call `compilecore.packed_mm` declares where oneDNN runs its products (16-bit weights on a
CPU without AVX512-BF16, or with AMX). `tiles_mm_into` is `compilecore.invariant_mm`'s
call: the library GEMM one 16-row tile at a time, as the op itself calls it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

from passes import native, native_calls
from passes.native_calls import NativeCall

# A byte copy into the output, not `aoti_torch_copy_`: that is an in-place write to an
# inference tensor, refused outside inference mode. shim = [linear, data_ptr, delete,
# failures, mm_out]: a replay cannot raise, so a failure is counted there and the graph's
# check raises after the replay.
_SOURCE = r"""
#include <cstdint>
#include <cstring>
typedef void* H;
typedef int32_t (*linear_fn)(H, H, H*, const char*, const double**, int64_t, const char**, H*);
typedef int32_t (*data_ptr_fn)(H, void**);
typedef int32_t (*delete_fn)(H);
extern "C" void onednn_linear_into(int64_t* shim, H x, H w, H b, void* y, int64_t nbytes) {
  H out = nullptr;
  void* data = nullptr;
  if (((linear_fn)shim[0])(x, w, b ? &b : nullptr, "none", nullptr, 0, nullptr, &out) != 0) {
    shim[3] += 1;
    return;
  }
  if (((data_ptr_fn)shim[1])(out, &data) == 0) std::memcpy(y, data, nbytes);
  else shim[3] += 1;
  ((delete_fn)shim[2])(out);
}
typedef int32_t (*mm_out_fn)(H, H, H);
// a's rows into the zero-padded rows of the tiles, then out tile t = a tile t @ b;
// tiles = [a tile 0, out tile 0, a tile 1, ...] (handles).
extern "C" void tiles_mm_into(int64_t* shim, const int64_t* tiles, int64_t num_tiles, H b,
                              void* full, const void* a, int64_t a_bytes) {
  std::memcpy(full, a, a_bytes);
  for (int64_t t = 0; t < num_tiles; ++t)
    if (((mm_out_fn)shim[4])((H)tiles[2 * t + 1], (H)tiles[2 * t], b) != 0) shim[3] += 1;
}
"""

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Handle:
    """An owning `AtenTensorHandle` (a heap `at::Tensor`) for a tensor, freed with this
    object: what the shim takes in place of a tensor."""

    def __init__(self, tensor: torch.Tensor):
        self.capsule = torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(tensor)
        self.address = _capsule_pointer(self.capsule, None)
        # Held here: at interpreter exit the module's globals may be gone before this.
        self._free = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr

    def __del__(self) -> None:
        self._free(self.capsule)


@functools.cache
def shim_call() -> tuple[ctypes._CFuncPtr, torch.Tensor] | None:
    """(the recordable oneDNN linear, the shim table), or None where this torch's
    libtorch_cpu lacks the shim functions or the functions cannot be built."""
    return None if (lib := _shim()) is None else (lib[0].onednn_linear_into, lib[1])


@functools.cache
def _shim() -> tuple[ctypes.CDLL, torch.Tensor] | None:
    if not hasattr(getattr(torch._C, "_aoti", None), "unsafe_alloc_void_ptr_from_tensor"):
        return None
    names = ("aoti_torch_cpu__linear_pointwise", "aoti_torch_get_data_ptr",
             "aoti_torch_delete_tensor_object", "aoti_torch_mm_out")  # fmt: skip
    try:
        libtorch = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                            "libtorch_cpu.so"))  # fmt: skip
        addresses = [native_calls.function_address(getattr(libtorch, name)) for name in names]
        root = native.cache_root() / "torch_compile"
        lib = native.load_library(_SOURCE, "onednn_shim", root, ["-O2", "-shared", "-fPIC"])
    except (OSError, AttributeError, native.KernelBuildError):
        return None
    native.declare(lib, "onednn_linear_into(ptr x5, i64)",
                   "tiles_mm_into(ptr, ptr, i64, ptr x3, i64)")  # fmt: skip
    return lib, torch.tensor([*addresses[:3], 0, addresses[3]], dtype=torch.int64)


@functools.cache
def _failure_count() -> Any:
    return _shim()[1].numpy()[3:4]  # a view of the table's count, made once


def failures() -> str | None:
    """Why the last replays' shim calls failed (the count is reset), or None: run after
    every replay of a graph that recorded the shim."""
    count = _failure_count()
    if count[0] == 0:
        return None
    count[0] = 0
    return "a library product through the AOTInductor shim failed"


def linear_call(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
) -> NativeCall | None:
    """The call writing `x @ w.T (+ bias)` on oneDNN's reordered weight into y through the
    shim (the bias inside oneDNN's product, as the op's own call adds it), or None where
    the shim is missing. Made once here (y gets the product), so a call that fails does so
    now rather than at a replay."""
    if (shim_fn := shim_call()) is None:
        return None
    fn, shim = shim_fn
    handles = tuple(Handle(t) for t in (x, packed) + (() if bias is None else (bias,)))
    b = handles[2].address if bias is not None else 0
    args = (shim, handles[0].address, handles[1].address, b, y, y.numel() * y.element_size())
    call = NativeCall(native_calls.function_address(fn), args, "compilecore.packed_mm", 0, fn,
                      keep=handles, check=failures)  # fmt: skip
    call.run()
    if (failure := failures()) is not None:
        raise RuntimeError(failure)
    return call


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory made outside inference mode: `mm_out` may write it from a
    replay, which runs outside inference mode."""
    storage = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    with torch.inference_mode(False):
        raw = torch.frombuffer(storage, dtype=torch.uint8)
        return raw.view(t.dtype).view(t.shape)


def tiles_mm_call(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: int, tile: int
) -> NativeCall | None:
    """The call writing `a @ b` into `out`'s storage (`rows` rows: a's, then zero rows up
    to whole tiles of `tile` rows), one library GEMM a tile, or None where the shim is
    missing. a: contiguous rows. Made once here, so a call that fails does so now."""
    if (lib := _shim()) is None:
        return None
    (m, k), n = a.shape, b.shape[1]
    with torch.inference_mode(False):
        full = torch.zeros(rows, k, dtype=a.dtype)
    y = _alias(out.as_strided((rows, n), (n, 1)))
    handles = [Handle(t) for i in range(0, rows, tile)
               for t in (full[i : i + tile], y[i : i + tile])]  # fmt: skip
    handles.append(Handle(b))
    tiles = torch.tensor([h.address for h in handles[:-1]], dtype=torch.int64)
    fn = lib[0].tiles_mm_into
    args = (lib[1], tiles, rows // tile, handles[-1].address, full, a, m * k * a.element_size())
    call = NativeCall(native_calls.function_address(fn), args, "compilecore.invariant_mm", 0, fn,
                      keep=(*handles, full, y, out), check=failures)  # fmt: skip
    call.run()
    if (failure := failures()) is not None:
        raise RuntimeError(failure)
    return call
