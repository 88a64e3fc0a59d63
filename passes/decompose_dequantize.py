"""Dequantization ops -> their reference's plain aten ops, for Inductor to fuse.

Unfused (what a quantized layer traces as, where `quantized_linear` did not fire):

    wd = compilecore.dequantize_q4(qw, scales, mins, dtype)

Rewritten (passes/ops/quantized.py, `dequantize_q4_ref`):

    q  = stack([qw & 15, qw >> 4]) ...            # the nibbles, in GGUF's order
    wd = convert(q * scales + mins, dtype)        # per group, in fp32

Left as an op, the dequantization is an opaque call writing the whole float weight; as
plain ops Inductor fuses it into its consumer: the batch-1 product's reduction loop
(`gemv_to_reduction`, the compiler's own quantized product) or the embedding's gather,
and for a prefill into one loop that writes the weight the GEMM then reads. Runs after
`quantized_linear`; one site per quantized weight left (and one for the embedding).
"""

from __future__ import annotations

import functools

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PatternPass, trace_pattern
from passes.ops.quantized import dequantize_q4_ref, dequantize_q8_ref, dequantized_dtype

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _patterns(dtype: torch.dtype) -> list[tuple]:
    ops = torch.ops.compilecore

    def q4(w, s, m):
        return ops.dequantize_q4.default(w, s, m, dtype)

    def q4_ref(w, s, m):
        return dequantize_q4_ref(w, s, m, dtype)

    def q8(w, s):
        return ops.dequantize_q8.default(w, s, dtype)

    def q8_ref(w, s):
        return dequantize_q8_ref(w, s, dtype)

    w4, w8 = torch.empty(8, 32, dtype=torch.uint8), torch.empty(8, 64, dtype=torch.int8)
    s, m = (torch.empty(8, 2, dtype=torch.float16) for _ in range(2))  # distinct inputs
    return [(q4, q4_ref, [w4, s, m]), (q8, q8_ref, [w8, s])]


class DecomposeDequantizePass(PatternPass):
    name = "decompose_dequantize"
    depends_on = ("passes.ops.quantized",)

    def register(self) -> None:
        for dtype in DTYPES:
            check = functools.partial(_produces, dtype=dtype)
            for search, replace, example in _patterns(dtype):
                register_replacement(
                    search, replace, example, trace_pattern, self.patterns, extra_check=check
                )


def _produces(match, dtype: torch.dtype) -> bool:
    return dequantized_dtype(match) == dtype
