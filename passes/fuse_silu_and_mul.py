"""SiLU of the gate half times the up half -> `compilecore.silu_and_mul`.

Unfused (what the merged gate/up projection's activation traces to):

    g = slice(gu, -1, 0, I);  u = slice(gu, -1, I, 2I)
    m = mul(silu(g), u)                         # converts around silu for 16-bit dtypes

Fused:

    m = compilecore.silu_and_mul(gu)

One site per decoder layer: L.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PatternPass, dtype_check, trace_pattern
from passes.ops.silu_and_mul import silu_and_mul_ref


def _search(gu):
    return silu_and_mul_ref(gu)


def _replace(gu):
    return torch.ops.compilecore.silu_and_mul.default(gu)


def _halves(match) -> bool:
    """The pattern's slice bounds are ignored when matching: check they are the halves."""
    gu = match.kwargs["gu"].meta.get("val")
    if not isinstance(gu, torch.Tensor) or not isinstance(gu.shape[-1], int):
        return False
    d = gu.shape[-1] // 2
    slices = [n for n in match.nodes if n.target == torch.ops.aten.slice.Tensor]
    bounds = sorted(tuple(n.args[2:4]) for n in slices)
    return (
        len(bounds) == 2
        and bounds[0][0] == 0
        and bounds[0][1] == d == bounds[1][0]
        and (bounds[1][1] >= 2 * d)
    )


class SiluAndMulFusionPass(PatternPass):
    name = "fuse_silu_and_mul"
    depends_on = ("passes.ops.silu_and_mul",)

    def register(self) -> None:
        of_dtype = dtype_check("gu", self.dtypes)
        for dtype in self.pattern_dtypes():
            register_replacement(
                _search,
                _replace,
                [torch.empty(4, 32, dtype=dtype)],
                trace_pattern,
                self.patterns,
                extra_check=lambda match: of_dtype(match) and _halves(match),
            )
