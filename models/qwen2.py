"""Qwen2: Llama with biases on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from torch import nn

from compilecore.config import EngineConfig
from models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def _make_attention(self, engine_config: EngineConfig, prefix: str, bias: bool) -> nn.Module:
        return LlamaAttention(
            engine_config=engine_config, prefix=prefix, bias=True, bias_o_proj=False
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, *, engine_config: EngineConfig, prefix: str = ""):
        config = engine_config.model_config.hf_config
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported yet")
        super().__init__(engine_config=engine_config, prefix=prefix, layer_type=Qwen2DecoderLayer)
