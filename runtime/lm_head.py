"""The LM head's kernels on CPU: the runtime's choice, made where it builds the step, not
in the model file (which keeps vLLM's contract: a `LogitsProcessor` and nothing else).

- one row (batch-1 decode): `compilecore.gemv_logits`, our C loop that reads the head at
  close to memory bandwidth (bf16 on AVX512-BF16; greedy steps may read its int8 screen,
  passes/ops/gemv.py), recorded into CPU graphs; else a compiled reduction loop;
- more rows: `compilecore.packed_mm` on a copy of the weight packed once, as the
  `packed_linear` pass runs the model's own products;
- a quantized head (a GGUF's Q8_0 or Q6_K): its own product on the blocks, with int8
  activations where `int8_activations` gives them to the model's q8 products; where our
  quantized kernels do not run (`native_kernels=False`, or a CPU they are not built for),
  the compiler's own: one row as a reduction Inductor fuses the dequantization into,
  more rows the reference dequantization and a GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from compilecore.compiled_function import StaticShapeFunction
from compilecore.config import EngineConfig
from models.layers.logits_processor import LogitsProcessor
from passes.manager import native_passes_built
from passes.ops import gemv, invariant_mm, packed_linear, quantized
from passes.ops.quantized import INVARIANT_ROWS


def batched_lm_head(engine_config: EngineConfig) -> Callable | None:
    cc, dtype = engine_config.compilation_config, engine_config.model_config.dtype
    if (
        engine_config.device.type != "cpu"
        or cc.mode == "none"
        or dtype not in packed_linear.supported_dtypes()
        or not cc.passes.resolved("cpu", native_passes_built())["packed_linear"]
    ):
        return None
    return torch.ops.compilecore.packed_mm


def small_batch_lm_head(engine_config: EngineConfig) -> Callable | None:
    cc = engine_config.compilation_config
    if engine_config.device.type != "cpu" or cc.mode == "none":
        return None
    if cc.passes.native_kernels and gemv.own_kernel_available(engine_config.model_config.dtype):
        return torch.ops.compilecore.gemv_logits
    return StaticShapeFunction(gemv.gemv_logits_reduction, engine_config)


def q4_logits_reduction(x, w, scales, mins):
    """A Q4 head's small-batch product in fp32, the dequantization inside the reduction."""
    values = quantized.dequantize_q4_ref(w, scales, mins, torch.float32)
    return (x.float().unsqueeze(1) * values.unsqueeze(0)).sum(-1)


def q8_logits_reduction(x, w, scales):
    """A Q8_0 (or Q6_K) head's small-batch product in fp32, likewise."""
    values = quantized.dequantize_q8_ref(w, scales, torch.float32)
    return (x.float().unsqueeze(1) * values.unsqueeze(0)).sum(-1)


def reference_values(fmt, fields) -> torch.Tensor:
    """A quantized head's values in fp32 by the reference's plain ops (no native op: the
    compiler's and batch-invariant mode's heads)."""
    dequantize = quantized.dequantize_q4_ref if fmt.has_mins else quantized.dequantize_q8_ref
    return dequantize(*fields, torch.float32)


def reads_blocks(engine_config: EngineConfig) -> bool:
    """Whether this engine's quantized products read the blocks (our kernels, on CPU, the
    `quantized_linear` pass on); the LM head's product follows the model's."""
    cc = engine_config.compilation_config
    return (
        engine_config.device.type == "cpu"
        and cc.mode != "none"
        and cc.passes.resolved("cpu", native_passes_built())["quantized_linear"]
    )


def compiled_quantized_head(engine_config: EngineConfig) -> Callable | None:
    """The quantized head's product where the model's quantized products are the
    compiler's (the `quantized_linear` pass off: `native_kernels=False`, or our kernels
    not built for this CPU): no native op, and one row fused, not the whole head
    dequantized every step."""
    cc = engine_config.compilation_config
    if engine_config.device.type != "cpu" or cc.mode == "none" or reads_blocks(engine_config):
        return None
    # Q6_K's 6-bit values are q8's held in fewer bits: the q8 reduction unpacks them.
    small = {True: StaticShapeFunction(q4_logits_reduction, engine_config),
             False: StaticShapeFunction(q8_logits_reduction, engine_config)}  # fmt: skip

    def product(x, fmt, fields, bias):
        if x.shape[0] <= LogitsProcessor.SMALL_BATCH and bias is None:
            return small[fmt.has_mins](x, *fields)
        return F.linear(x.float(), reference_values(fmt, fields), bias)

    return product


def invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return invariant_mm.invariant_mm_op(x, w.t())


def invariant_quantized_head(x, fmt, fields, bias):
    """Batch-invariant mode's quantized head where our quantized kernels do not run: the
    reference dequantization, then the one product kernel for every row count
    (passes/ops/invariant_mm.py)."""
    logits = invariant_mm.invariant_mm_op(x.float(), reference_values(fmt, fields).t())
    return logits if bias is None else logits + bias


def invariant_blocks_head(x, fmt, fields, bias):
    """Batch-invariant mode's quantized head where the model's products read the blocks:
    the row products (the `invariant` argument's path up to INVARIANT_ROWS rows) at every
    row count, so at most that many rows a call (a long step may sample more)."""
    rows = INVARIANT_ROWS
    if x.shape[0] <= rows:
        return fmt.product(x, fields, bias, torch.float32, invariant=True)
    return torch.cat([fmt.product(x[i : i + rows], fields, bias, torch.float32, invariant=True)
                      for i in range(0, x.shape[0], rows)])  # fmt: skip


def choose_lm_head_kernels(model: nn.Module, engine_config: EngineConfig) -> None:
    """Give every `LogitsProcessor` of `model` this engine's LM head kernels."""
    cc = engine_config.compilation_config
    if cc.batch_invariant:  # one kernel for every row count
        blocks = reads_blocks(engine_config)
        for module in model.modules():
            if isinstance(module, LogitsProcessor):
                module.small_batch_gemv, module.linear = None, invariant_linear
                module.int8_activations = False
                module.quantized_product = (
                    invariant_blocks_head if blocks else invariant_quantized_head
                )
        return
    small, batched = small_batch_lm_head(engine_config), batched_lm_head(engine_config)
    # As the quantized_linear pass gives the model's q8 products (eager stays exact: the
    # reference for compiled).
    int8 = cc.passes.int8_x(engine_config.device.type) and reads_blocks(engine_config)
    quantized_head = compiled_quantized_head(engine_config)
    for module in model.modules():
        if isinstance(module, LogitsProcessor):
            module.small_batch_gemv, module.linear = small, batched
            module.int8_activations = bool(int8)
            module.quantized_product = quantized_head
