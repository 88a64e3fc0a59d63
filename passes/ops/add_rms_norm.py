"""`fused_add_rms_norm(x, residual, weight, eps) -> (out, x + residual)`.

One pass over a row: add the residual, keep the sum as the new residual, normalize it
in fp32 and scale by the weight (cast back before the weight, as HF does)."""

from __future__ import annotations

import torch

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


_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def add_rms_norm_kernel(
            x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps, BLOCK: tl.constexpr
        ):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            mask = cols < n_cols
            offs = row * n_cols + cols
            dtype = out_ptr.dtype.element_ty
            # fp32 arithmetic, rounded to the input dtype wherever the unfused graph rounds
            # (the add, the normalized value, the weight product): same results, and the
            # interpreter has no 16-bit float arithmetic.
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(dtype)
            tl.store(new_res_ptr + offs, s, mask=mask)
            sf = s.to(tl.float32)
            var = tl.sum(sf * sf, axis=0) / n_cols
            normed = (sf * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs, (w * normed).to(dtype), mask=mask)

        _kernel = add_rms_norm_kernel
    return _kernel


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


@torch.library.custom_op("compilecore::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)
