"""`fused_add_rms_norm(x, residual, weight, eps) -> (out, x + residual)`.

One pass over a row: add the residual, keep the sum as the new residual, normalize it
in fp32 and scale by the weight (cast back before the weight, as HF does)."""

from __future__ import annotations

import torch

from passes import native_calls
from passes.native_calls import NativeCall
from passes.ops import layer_kernels
from passes.ops.triton_utils import next_power_of_2, row_num_warps, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32, cast back before the weight: exactly HF transformers' LlamaRMSNorm."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _get_kernel():
    from passes.ops.triton_fused import add_rms_norm_kernel

    return add_rms_norm_kernel


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    hidden = x.shape[-1]
    out, new_res = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // hidden
    if rows:
        block = next_power_of_2(hidden)
        _get_kernel()[(rows,)](
            x, residual, weight, out, new_res, hidden, eps, BLOCK=block,
            num_warps=row_num_warps(block),
        )  # fmt: skip
    return out, new_res


def _native_call(args: tuple, outs: tuple) -> NativeCall | None:
    """Our C loop (`layer_kernels.cpp`) for bf16 on CPU; None elsewhere."""
    return layer_kernels.add_rms_norm_call(*args, *outs)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    outs = (torch.empty_like(x), torch.empty_like(x))
    call = _native_call((x, residual, weight, eps), outs) if x.device.type == "cpu" else None
    if call is None:
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    call.run()
    return outs


def _fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


# Through `torch.library.Library`, not the `custom_op` decorator, whose Python wrapper costs ~8
# us a call (docs/kernel-choices.md, Library registration): the symbolic-size code calls it 2L
# times a step.
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define(
    "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"
)
for _key in ("CPU", "CUDA"):
    _LIB.impl("fused_add_rms_norm", fused_add_rms_norm, _key)
torch.library.register_fake("compilecore::fused_add_rms_norm", _fake, lib=_LIB)
native_calls.declare_entry("compilecore::fused_add_rms_norm", _native_call)
