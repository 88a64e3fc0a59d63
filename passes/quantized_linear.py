"""Products with block-quantized weights -> `compilecore.q4_linear` / `q8_linear`, which
read the blocks directly (passes/ops/quant_kernels.cpp).

Unfused (a quantized linear layer: the weight dequantized, then the product):

    wd = compilecore.dequantize_q4(qw, scales, mins, dtype)      # [N, K]
    y  = mm(x, permute(wd, [1, 0]))                             # x [M, K]
    y  = addmm(b, x, permute(wd, [1, 0]))                       # with a bias

Fused:

    y  = compilecore.q4_linear(qw, ...)                          # never materializes wd
    y  = compilecore.q4_linear(x, qw, scales, mins, b)

The same for `dequantize_q8` -> `q8_linear`. Every product on CPU, at any token count: the op
reads the blocks directly for up to `MAX_KERNEL_ROWS` (32 for q4, 128 for q8) rows, where a
product is bound by reading its weight (decode; a CPU graph records the call), and dequantizes
once into a dense GEMM for more (larger batches, a prefill: compute- bound); with AVX512-BF16
bf16 products read them further (`BF16_ROWS`: q4 64, q8 all). The choice is made per call, so
the symbolic-size code serves batched decode from the blocks too. One site per linear layer: 4
per Llama layer. Runs before every pass that takes plain products (native_linear,
gemv_to_reduction, packed_linear), which would otherwise take the dequantized weight for an
ordinary one; with it off (`native_kernels=False`), `decompose_dequantize` hands the pair to
Inductor. With `int8_activations` (CPU default) the q8 products take `int8_x=True` (Q8_0's and
Q6_K's products quantize x as llama.cpp does), and so do the q4 products of Q4_K's compact
fields (docs/kernel-choices.md, Int8 activations).
"""

from __future__ import annotations

import functools

import torch
from torch._inductor.pattern_matcher import register_replacement

from passes.base import PatternPass, trace_pattern
from passes.ops.quantized import dequantized_dtype, q4_int8_x

DTYPES = (torch.bfloat16, torch.float32)


def _patterns(dtype: torch.dtype, int8_x: bool, invariant: bool) -> list[tuple]:
    ops = torch.ops.compilecore

    def mm_q4(x, w, s, m):
        return torch.mm(x, ops.dequantize_q4.default(w, s, m, dtype).permute(1, 0))

    def addmm_q4(b, x, w, s, m):
        return torch.addmm(b, x, ops.dequantize_q4.default(w, s, m, dtype).permute(1, 0))

    def mm_q8(x, w, s):
        return torch.mm(x, ops.dequantize_q8.default(w, s, dtype).permute(1, 0))

    def addmm_q8(b, x, w, s):
        return torch.addmm(b, x, ops.dequantize_q8.default(w, s, dtype).permute(1, 0))

    # q4: `q4_int8_x` decides per match (the replacement is traced on its own inputs)
    def q4(x, w, s, m):
        return ops.q4_linear.default(x, w, s, m, None, None, q4_int8_x(s, int8_x), invariant)

    def q4_bias(b, x, w, s, m):
        return ops.q4_linear.default(x, w, s, m, b, None, q4_int8_x(s, int8_x), invariant)

    def q8(x, w, s):
        return ops.q8_linear.default(x, w, s, None, None, int8_x, invariant)

    def q8_bias(b, x, w, s):
        return ops.q8_linear.default(x, w, s, b, None, int8_x, invariant)

    n, k = 8, 64
    x, b = torch.empty(2, k, dtype=dtype), torch.empty(n, dtype=dtype)
    w4, w8 = torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k, dtype=torch.int8)
    s, m = (torch.empty(n, k // 32, dtype=torch.float16) for _ in range(2))  # distinct inputs
    return [
        (mm_q4, q4, [x, w4, s, m]),
        (addmm_q4, q4_bias, [b, x, w4, s, m]),
        (mm_q8, q8, [x, w8, s]),
        (addmm_q8, q8_bias, [b, x, w8, s]),
    ]


def _on_device(match, dtype: torch.dtype) -> bool:
    x = match.kwargs["x"].meta.get("val")
    return (
        dequantized_dtype(match) == dtype
        and isinstance(x, torch.Tensor)
        and x.dim() == 2
        and x.device.type in ("cpu", "cuda")
    )


class QuantizedLinearPass(PatternPass):
    """`int8_x`: the q8 products may quantize activations as llama.cpp does, where the
    exact products are compute-bound (`compilecore.q8_linear`'s argument;
    PassConfig.int8_activations). `invariant` (batch-invariant mode): every product reads
    the blocks with the row products at any row count, so that a row's bits do not depend
    on the batch (tests/test_batch_invariant.py); no int8 activations then."""

    name = "quantized_linear"
    depends_on = ("passes.ops.quantized",)

    def __init__(self, int8_x: bool = False, invariant: bool = False):
        self.int8_x, self.invariant = int8_x and not invariant, invariant
        super().__init__()

    def config(self) -> dict:
        return super().config() | {"int8_x": self.int8_x, "invariant": self.invariant}

    def register(self) -> None:
        for dtype in DTYPES:
            check = functools.partial(_on_device, dtype=dtype)
            for search, replace, example in _patterns(dtype, self.int8_x, self.invariant):
                register_replacement(
                    search, replace, example, trace_pattern, self.patterns, extra_check=check
                )
