"""Small static-M products on CUDA -> split-K partial sums that the consumer adds up.

Unfused (a linear layer in a piece compiled for a static token count M <= MAX_ROWS):

    y = mm(x, permute(w, [1, 0]))          # x [M, K], w [N, K]: cuBLAS's GEMV

Rewritten:

    p = compilecore.gemv_partials(x, w, S)  # [S, M, N] fp32: K split S ways (Triton)
    y = convert(sum(p, [0]), dtype)         # fused by Inductor into y's consumer

S = `choose_splits(N, K)`: enough programs for the device's SMs at small N (the 1B
model's QKV and o projections), 1 for large N, where the sum is a no-op. One site per
linear layer of the static-size pieces (4 a Llama layer). Off by default: turned on with
`passes={"splitk_gemv": True}` and `compile_sizes=[1]`; `benchmarks/gpu_check.py`'s
`splitk_gemv` step times it against cuBLAS on a device (not yet run).
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PatternPass, trace_pattern
from passes.ops import gemv_partials as ops


def _search(x, w):
    return torch.mm(x, w.permute(1, 0))


def _replace(x, w):
    splits = ops.choose_splits(w.shape[0], w.shape[1])
    partials = torch.ops.compilecore.gemv_partials(x, w, splits)
    return partials.sum(dim=0).to(x.dtype)


class SplitKGemvPass(PatternPass):
    name = "splitk_gemv"
    depends_on = ("passes.ops.gemv_partials",)

    def register(self) -> None:
        def small_static_m(match) -> bool:
            x = match.kwargs["x"]
            value = x.meta.get("val") if hasattr(x, "meta") else None
            rows = value.shape[0] if isinstance(value, torch.Tensor) else None
            return isinstance(rows, int) and rows <= ops.MAX_ROWS

        x, w = torch.empty(2, 16), torch.empty(8, 16)
        register_replacement(
            _search, _replace, [x, w], trace_pattern, self.patterns, extra_check=small_static_m
        )
