"""`fused_allreduce_add_rms_norm(x, residual, weight, eps, group_name) -> (out, new_residual)`:
the tensor-parallel all-reduce of a row-parallel layer's partial sums, then the fused
residual add and RMSNorm. This is the generic form; a GPU form that overlaps the
reduction with the norm (one-shot symmetric-memory all-reduce, or reduce-scatter, norm on
1/TP of the rows, all-gather) can replace the body without changing the pass."""

from __future__ import annotations

import torch

from passes.ops.add_rms_norm import fused_add_rms_norm


@torch.library.custom_op("compilecore::fused_allreduce_add_rms_norm", mutates_args=())
def fused_allreduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    reduced = torch.ops._c10d_functional.all_reduce.default(x, "sum", group_name)
    reduced = torch.ops._c10d_functional.wait_tensor.default(reduced)
    return fused_add_rms_norm(reduced, residual, weight, eps)


@fused_allreduce_add_rms_norm.register_fake
def _(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(x)
