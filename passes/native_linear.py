"""Batch-1 linear layers -> `compilecore.linear` (our C loop over the weight rows).

Unfused (a linear layer in the one-token code; `addmm` where the layer has a bias, as
Qwen2's q/k/v projections do):

    y = mm(x, permute(w, [1, 0]))               # x [1, K], w [N, K] bf16 on CPU
    y = addmm(b, x, permute(w, [1, 0]))

Fused:

    y = compilecore.linear(x, w)
    y = compilecore.linear(x, w, b)

Only pieces compiled for one token (the static size-1 code) where the C loop builds
(`passes.ops.layer_kernels.available`): there Inductor's extern GEMM reads bf16 weights at about
half the memory's speed and its own reduction loop (`gemv_to_reduction`, the fallback) at ~0.9
of ours (docs/kernel-choices.md, Static-size code and The layer region). One site per linear
layer: 4 per Llama layer.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PatternPass, is_graph_input, trace_pattern


def mm_search(x, w):
    """A linear layer without a bias, as the post-grad graph holds it."""
    return torch.mm(x, w.permute(1, 0))


def _linear(x, w):
    return torch.ops.compilecore.linear.default(x, w)


def addmm_search(b, x, w):
    """A linear layer with a bias."""
    return torch.addmm(b, x, w.permute(1, 0))


def _linear_bias(b, x, w):
    return torch.ops.compilecore.linear.default(x, w, b)


def is_applicable(rows: object, dtype: torch.dtype, device: torch.device) -> bool:
    """Where the pass rewrites a product: one static row of bf16 on CPU (symbolic sizes,
    the code for every batch, are never compared)."""
    return isinstance(rows, int) and rows == 1 and dtype == torch.bfloat16 and device.type == "cpu"


def _one_bf16_row(match) -> bool:
    if not is_graph_input(match.kwargs["w"]):  # the kernel's unrolled rows read a weight
        return False
    x = match.kwargs["x"].meta.get("val")
    w = match.kwargs["w"].meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 2:
        return False
    return w.dtype == x.dtype and is_applicable(x.shape[0], x.dtype, x.device)


class NativeLinearPass(PatternPass):
    name = "native_linear"
    depends_on = ("passes.ops.linear",)

    def register(self) -> None:
        bf16 = dict(dtype=torch.bfloat16)
        x, w, b = torch.empty(2, 16, **bf16), torch.empty(8, 16, **bf16), torch.empty(8, **bf16)
        patterns = ((mm_search, _linear, [x, w]), (addmm_search, _linear_bias, [b, x, w]))
        for search, replace, example in patterns:
            register_replacement(
                search, replace, example, trace_pattern, self.patterns, extra_check=_one_bf16_row
            )
