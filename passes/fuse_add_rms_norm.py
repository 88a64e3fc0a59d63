"""Residual add + RMSNorm -> `compilecore.fused_add_rms_norm`.

Unfused (what `RMSNorm(x, residual)` traces to; the converts only for 16-bit dtypes):

    s   = add(x, residual)                  # the new residual
    f   = convert_element_type(s, f32)
    var = mean(pow(f, 2), [-1], keepdim)
    n   = mul(f, rsqrt(add(var, eps)))
    out = mul(weight, convert_element_type(n, dtype))

Fused:

    out, s = compilecore.fused_add_rms_norm(x, residual, weight, eps)

Matches whether or not `s` is used later (the final norm drops it), for any eps. In a
Llama with L layers: 2L sites (every decoder layer's post-attention norm, the input norm
of layers 1..L-1, and the final norm; layer 0's input norm has no residual).
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PATTERN_DTYPES, PatternPass, dtype_check, trace_pattern
from passes.ops.add_rms_norm import fused_add_rms_norm_ref

_EPS_PLACEHOLDER = 1.2345e-7  # a value no real pattern constant has


def _search(x, residual, weight, eps):
    out, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
    return out, summed


def _replace(x, residual, weight, eps):
    out = torch.ops.compilecore.fused_add_rms_norm.default(x, residual, weight, eps)
    return out[0], out[1]


def register_norm_patterns(search, replace, patterns, dtypes=None) -> None:
    """Register a (x, residual, weight, eps) -> (out, new_residual) pattern for every
    dtype (or those of `dtypes`), with eps matched as any value."""
    for dtype in PATTERN_DTYPES if dtypes is None else dtypes:
        x, residual, weight = (torch.empty(4, 16, dtype=dtype) for _ in range(3))
        register_replacement(
            search,
            replace,
            [x, residual, weight[0]],
            trace_pattern,
            patterns,
            scalar_workaround={"eps": _EPS_PLACEHOLDER},
            extra_check=dtype_check("x", dtypes),
        )


class AddRMSNormFusionPass(PatternPass):
    name = "fuse_add_rms_norm"
    depends_on = ("passes.ops.add_rms_norm",)

    def register(self) -> None:
        register_norm_patterns(_search, _replace, self.patterns, self.dtypes)
