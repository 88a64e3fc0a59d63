"""CPU GEMMs with 16-bit weights -> `compilecore.packed_mm` (the weight packed once).

Unfused:

    wt = permute(w, [1, 0])
    y  = mm(x, wt)                      # x [M, K], w [N, K] bf16 (fp16) on CPU
    y  = addmm(b, x, wt)                # a layer with a bias (Qwen2's q/k/v)

Rewritten:

    y  = compilecore.packed_mm(x, w)    # our kernel (or oneDNN) on a cached packed copy of w
    y  = compilecore.packed_mm(x, w, b) # the bias added before the one rounding

Runs after `native_linear` and `gemv_to_reduction`, so the batch-1 pieces keep theirs and this
takes every other size (the symbolic-size code: prefill chunks and batched decode). One
site per linear layer: 4 per Llama layer. Inductor can no longer fold a following residual
add into the GEMM (`addmm`); the add joins the RMSNorm's loop instead.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PatternPass, is_graph_input, trace_pattern
from passes.native_linear import addmm_search, mm_search
from passes.ops.packed_linear import supported_dtypes


def _replace(x, w):
    return torch.ops.compilecore.packed_mm.default(x, w)


def _replace_bias(b, x, w):
    return torch.ops.compilecore.packed_mm.default(x, w, b)


def _cpu_16bit(match) -> bool:
    if not is_graph_input(match.kwargs["w"]):  # packed once: it must be a weight
        return False
    values = [n.meta.get("val") for n in (match.kwargs["x"], match.kwargs["w"])]
    return all(
        isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype in supported_dtypes()
        for v in values
    )


class PackedLinearPass(PatternPass):
    name = "packed_linear"
    depends_on = ("passes.ops.packed_linear", "passes.native_linear")

    def register(self) -> None:
        # One registration serves both dtypes: the pattern has no converts; the check
        # looks at the matched tensors.
        bf16 = dict(dtype=torch.bfloat16)
        x, w, b = torch.empty(2, 16, **bf16), torch.empty(8, 16, **bf16), torch.empty(8, **bf16)
        for search, replace, example in ((mm_search, _replace, [x, w]),
                                         (addmm_search, _replace_bias, [b, x, w])):  # fmt: skip
            register_replacement(
                search, replace, example, trace_pattern, self.patterns, extra_check=_cpu_16bit
            )
