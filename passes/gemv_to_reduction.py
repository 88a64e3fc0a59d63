"""Small-batch GEMMs -> reductions that Inductor generates as vector loops (CPU decode).

At batch 1 a linear layer is a matrix-vector product bounded by reading the weight. The library
GEMM called through `extern_kernels.mm` reads bf16 weights at about half the memory bandwidth on
this CPU; the same product written as a multiply and a reduction over K, which Inductor turns
into one vectorized C++ loop with fp32 accumulation, reads them at nearly the full bandwidth
(docs/kernel-choices.md, Static-size code). Only pieces compiled for a static token count of at
most `max_m` are rewritten (the `compile_sizes` artifacts).

Unfused:

    wt = permute(w, [1, 0])
    y  = mm(x, wt)                      # x [M, K], w [N, K], M static and small

Rewritten:

    xf = convert(unsqueeze(x, 1), f32); wf = convert(unsqueeze(w, 0), f32)
    y  = convert(sum(mul(xf, wf), [-1]), dtype)
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PatternPass, trace_pattern
from passes.ops.gemv import gemv_reduction


def _search(x, w):
    return torch.mm(x, w.permute(1, 0))


def _replace(x, w):
    return gemv_reduction(x, w)


class GemvToReductionPass(PatternPass):
    name = "gemv_to_reduction"
    depends_on = ("passes.ops.gemv",)

    # One row: at M = 4 Inductor's loops for the reduction re-read each weight row per row of x
    # and ran 8x slower than the library GEMM (docs/kernel-choices.md, Static-size code).
    def __init__(self, max_m: int = 1):
        self.max_m = max_m
        super().__init__()

    def config(self) -> dict:
        return {"max_m": self.max_m}

    def register(self) -> None:
        max_m = self.max_m

        def small_static_m(match) -> bool:
            x = match.kwargs["x"]
            value = x.meta.get("val") if hasattr(x, "meta") else None
            rows = value.shape[0] if isinstance(value, torch.Tensor) else None
            return isinstance(rows, int) and rows <= max_m

        # One registration serves every dtype: the pattern has no converts, and the
        # replacement is traced again with the matched tensors.
        x, w = torch.empty(2, 16), torch.empty(8, 16)
        register_replacement(
            _search, _replace, [x, w], trace_pattern, self.patterns, extra_check=small_static_m
        )
