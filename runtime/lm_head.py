"""The LM head's kernels on CPU: the runtime's choice, made where it builds the step, not
in the model file (which keeps vLLM's contract: a `LogitsProcessor` and nothing else).

- one row (batch-1 decode): `compilecore.gemv_logits`, our C loop that reads the head at
  close to memory bandwidth (bf16 on AVX512-BF16; greedy steps may read its int8 screen,
  passes/ops/gemv.py), recorded into CPU graphs; else a compiled reduction loop;
- more rows: `compilecore.packed_mm` on a copy of the weight packed once, as the
  `packed_linear` pass runs the model's own products;
- a quantized head (a GGUF's Q8_0 or Q6_K): its own product on the blocks, with int8
  activations where `int8_activations` gives them to the model's q8 products.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from compilecore.compiled_function import StaticShapeFunction
from compilecore.config import EngineConfig
from models.layers.logits_processor import LogitsProcessor
from passes.ops import gemv, packed_linear


def batched_lm_head(engine_config: EngineConfig) -> Callable | None:
    cc, dtype = engine_config.compilation_config, engine_config.model_config.dtype
    if (
        engine_config.device.type != "cpu"
        or cc.mode == "none"
        or dtype not in packed_linear.supported_dtypes()
        or not cc.passes.resolved("cpu")["packed_linear"]
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


def choose_lm_head_kernels(model: nn.Module, engine_config: EngineConfig) -> None:
    """Give every `LogitsProcessor` of `model` this engine's LM head kernels."""
    small, batched = small_batch_lm_head(engine_config), batched_lm_head(engine_config)
    cc = engine_config.compilation_config
    # As the quantized_linear pass gives the model's q8 products (eager stays exact: the
    # reference for compiled).
    device = engine_config.device.type
    int8 = (
        cc.mode != "none"
        and cc.passes.int8_x(device)
        and cc.passes.resolved(device)["quantized_linear"]
    )
    for module in model.modules():
        if isinstance(module, LogitsProcessor):
            module.small_batch_gemv, module.linear = small, batched
            module.int8_activations = bool(int8)
