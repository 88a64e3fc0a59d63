"""Mistral: the Llama architecture under another name (no sliding window here)."""

from __future__ import annotations

from compilecore.config import EngineConfig
from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, *, engine_config: EngineConfig, prefix: str = ""):
        config = engine_config.model_config.hf_config
        window = getattr(config, "sliding_window", None)
        if window is not None and window < engine_config.model_config.max_model_len:
            raise ValueError(
                f"Mistral sliding_window={window} is shorter than max_model_len="
                f"{engine_config.model_config.max_model_len}; sliding-window attention is not "
                "supported yet: pass max_model_len <= sliding_window"
            )
        super().__init__(engine_config=engine_config, prefix=prefix)
