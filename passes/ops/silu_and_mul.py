"""`silu_and_mul(x) -> silu(x[..., :d]) * x[..., d:]`: the merged gate/up projection's
activation (vLLM's `SiluAndMul`), in our C loop for bf16 on CPU (`layer_kernels.cpp`),
its torch reference otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from passes import native_calls
from passes.native_calls import NativeCall
from passes.ops import layer_kernels


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _native_call(args: tuple, out: torch.Tensor) -> NativeCall | None:
    return layer_kernels.silu_and_mul_call(args[0], out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    call = _native_call((x,), out)
    if call is None:
        return silu_and_mul_ref(x)
    call.run()
    return out


def _fake_silu_and_mul(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("silu_and_mul(Tensor x) -> Tensor")
_LIB.impl("silu_and_mul", silu_and_mul, "CPU")
_LIB.impl("silu_and_mul", silu_and_mul_ref, "CUDA")
torch.library.register_fake("compilecore::silu_and_mul", _fake_silu_and_mul, lib=_LIB)
native_calls.declare_entry("compilecore::silu_and_mul", _native_call)
