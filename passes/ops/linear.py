"""`linear(x, w, bias=None) -> x @ w^T (+ bias)`: a linear layer's product, in our C
loop for one bf16 row on CPU (`layer_kernels.cpp`: each thread one sequential run of
weight rows), `torch.nn.functional.linear` otherwise. What `passes/native_linear.py`
puts in place of a batch-1 `mm` or `addmm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from passes import native_calls
from passes.native_calls import NativeCall
from passes.ops import layer_kernels


def _native_call(args: tuple, out: torch.Tensor) -> NativeCall | None:
    x, w, bias = (*args, None)[:3]
    return layer_kernels.linear_call(x, w, bias, out)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.new_empty(x.shape[0], w.shape[0])
    call = _native_call((x, w, bias), y)
    if call is None:
        return F.linear(x, w, bias)
    call.run()
    return y


def _fake_linear(x, w, bias=None):
    return x.new_empty(x.shape[0], w.shape[0])


# Through `torch.library.Library`, not the `custom_op` decorator, whose Python wrapper costs ~8
# us a call (docs/kernel-choices.md, Library registration).
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor")
_LIB.impl("linear", linear, "CPU")
_LIB.impl("linear", lambda x, w, bias=None: F.linear(x, w, bias), "CUDA")
torch.library.register_fake("compilecore::linear", _fake_linear, lib=_LIB)
native_calls.declare_entry("compilecore::linear", _native_call)
