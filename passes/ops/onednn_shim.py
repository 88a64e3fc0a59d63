"""oneDNN's linear as a C call a CPU graph can record: `aoti_torch_cpu__linear_pointwise`,
the entry point AOTInductor's generated code uses, exported by libtorch_cpu as plain C.

A small C function calls it on tensor handles (heap `at::Tensor`s made once at capture)
and copies the result's bytes into the output buffer the graph keeps. It is the
call `compilecore.packed_mm` declares where oneDNN runs its products (16-bit weights on a
CPU without AVX512-BF16, or with AMX), so a CPU graph can replay them.
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
# failures]: a replay cannot raise, so a failure is counted there and the graph's check
# raises after the replay.
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
    """(the recordable C function, its shim table), or None where this torch's libtorch_cpu
    lacks the shim functions or the function cannot be built."""
    if not hasattr(getattr(torch._C, "_aoti", None), "unsafe_alloc_void_ptr_from_tensor"):
        return None
    names = ("aoti_torch_cpu__linear_pointwise", "aoti_torch_get_data_ptr",
             "aoti_torch_delete_tensor_object")  # fmt: skip
    try:
        libtorch = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                            "libtorch_cpu.so"))  # fmt: skip
        addresses = [native_calls.function_address(getattr(libtorch, name)) for name in names]
        root = native.cache_root() / "torch_compile"
        lib = native.load_library(_SOURCE, "onednn_shim", root, ["-O2", "-shared", "-fPIC"])
    except (OSError, AttributeError, native.KernelBuildError):
        return None
    fn = native.declare(lib, "onednn_linear_into(ptr x5, i64)").onednn_linear_into
    return fn, torch.tensor([*addresses, 0], dtype=torch.int64)


@functools.cache
def _failure_count() -> Any:
    return shim_call()[1].numpy()[3:]  # a view of the table's count, made once


def failures() -> str | None:
    """Why the last replays' shim calls failed (the count is reset), or None: run after
    every replay of a graph that recorded the shim."""
    count = _failure_count()
    if count[0] == 0:
        return None
    count[0] = 0
    return "oneDNN's linear through the AOTInductor shim failed"


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
