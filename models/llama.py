"""Llama, written with vLLM's model-file contract.

Every constructor takes the engine config and its `prefix` (the dotted attribute path)
keyword-only; linear layers and the embedding are tensor-parallel and load their own
slice; pipeline stages hold placeholders for the layers other stages own. The same math
and parameter tree as HF transformers' `LlamaForCausalLM`, over a flat token dimension.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from compilecore.config import EngineConfig
from compilecore.decorators import support_torch_compile
from compilecore.parallel_state import get_pp_group, get_tensor_model_parallel_world_size
from compilecore.recipe import mark_weights_changed
from models.interfaces import SupportsPP, SupportsTP
from models.layers.activation import SiluAndMul
from models.layers.attention import Attention
from models.layers.layernorm import RMSNorm
from models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShapeMismatchError,
    default_weight_loader,
)
from models.layers.logits_processor import LogitsProcessor
from models.layers.quantization import QuantizationConfig
from models.layers.rotary_embedding import get_rope, rope_settings
from models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from models.utils import (
    IntermediateTensors,
    PPMissingLayer,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)


class WeightLoadError(ValueError):
    pass


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.prefix = prefix
        if hidden_act != "silu":
            raise ValueError(f"Unsupported activation: {hidden_act}. Only silu is supported.")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )  # fmt: skip
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class LlamaAttention(nn.Module):
    def __init__(
        self,
        *,
        engine_config: EngineConfig,
        prefix: str,
        bias: bool = False,
        bias_o_proj: bool = False,
    ):
        super().__init__()
        self.prefix = prefix
        config = engine_config.model_config.hf_config
        tp_size = get_tensor_model_parallel_world_size()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        if self.total_num_heads % tp_size:
            raise ValueError(
                f"num_attention_heads ({self.total_num_heads}) must be divisible by "
                f"tensor parallel size ({tp_size})"
            )
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = (
            getattr(config, "num_key_value_heads", None) or self.total_num_heads
        )
        # Fewer KV heads than ranks: each rank keeps one (replicated) KV head.
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = (
            getattr(config, "head_dim", None) or self.hidden_size // self.total_num_heads
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5

        quant_config = engine_config.model_config.quant_config
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            self.hidden_size,
            bias=bias_o_proj,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        theta, scaling = rope_settings(config)
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.head_dim,
            max_position=config.max_position_embeddings,
            base=theta,
            rope_scaling=scaling,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            engine_config=engine_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(attn_output)
        return output


class LlamaDecoderLayer(nn.Module):
    def __init__(self, *, engine_config: EngineConfig, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        config = engine_config.model_config.hf_config
        attention_bias = getattr(config, "attention_bias", False)
        self.self_attn = self._make_attention(engine_config, f"{prefix}.self_attn", attention_bias)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
            quant_config=engine_config.model_config.quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _make_attention(self, engine_config: EngineConfig, prefix: str, bias: bool) -> nn.Module:
        """Subclasses override this to change the projections' biases (Qwen2)."""
        return LlamaAttention(
            engine_config=engine_config, prefix=prefix, bias=bias, bias_o_proj=bias
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stays outside the norm: norm(x, residual) adds, then normalizes.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class LlamaModel(nn.Module):
    def __init__(
        self,
        *,
        engine_config: EngineConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = LlamaDecoderLayer,
    ):
        super().__init__()
        self.prefix = prefix
        config = engine_config.model_config.hf_config
        self.config = config
        self.vocab_size = config.vocab_size
        pp = get_pp_group()
        tie = getattr(config, "tie_word_embeddings", False)
        if pp.is_first_rank or (tie and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size,
                quant_config=engine_config.model_config.quant_config,
                prefix=f"{prefix}.embed_tokens",
            )  # fmt: skip
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda p: layer_type(engine_config=engine_config, prefix=p),
            prefix=f"{prefix}.layers",
        )
        if pp.is_last_rank:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        pp = get_pp_group()
        if pp.is_first_rank:
            hidden_states = (
                inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            )
            residual = None
        else:
            assert intermediate_tensors is not None, "a later pipeline stage needs its inputs"
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not pp.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module, SupportsPP, SupportsTP):
    # Internal fused projections and the checkpoint names they are made from (LoRA, loading).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    # (param name, checkpoint name, shard id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(
        self,
        *,
        engine_config: EngineConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = LlamaDecoderLayer,
    ):
        super().__init__()
        self.prefix = prefix
        config = engine_config.model_config.hf_config
        self.config = config
        self.model = self._init_model(
            engine_config=engine_config, prefix=maybe_prefix(prefix, "model"), layer_type=layer_type
        )
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size,
                quant_config=engine_config.model_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )  # fmt: skip
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(
                config.vocab_size,
                scale=getattr(config, "logit_scale", 1.0),
            )
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def _init_model(
        self, *, engine_config: EngineConfig, prefix: str, layer_type: type[nn.Module]
    ) -> LlamaModel:
        return LlamaModel(engine_config=engine_config, prefix=prefix, layer_type=layer_type)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def _skip(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
            return True
        if name.startswith("lm_head.") and getattr(self.config, "tie_word_embeddings", False):
            return True  # tied: the embedding's weight is the head's
        return is_pp_missing_parameter(name, self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (HF names); returns the names of parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[str, set] = {}  # stacked parameter -> the shards loaded into it
        for ckpt_name, tensor in weights:
            if self._skip(ckpt_name):
                continue
            name, shard_id = ckpt_name, None
            for param_part, ckpt_part, sid in self.stacked_params_mapping:
                if ckpt_part in ckpt_name:
                    name, shard_id = ckpt_name.replace(ckpt_part, param_part), sid
                    break
            whole = shard_id is not None and name not in params and f"{name}_{shard_id}" in params
            if whole:  # a part of a fused layer held in its own format (its own parameter)
                name = f"{name}_{shard_id}"
            if name not in params:
                raise WeightLoadError(
                    f"unexpected weight {ckpt_name!r}: {type(self).__name__} has no parameter "
                    f"{name!r} (is this checkpoint for another architecture?)"
                )
            param = params[name]
            loader: Any = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except ShapeMismatchError as e:
                raise WeightLoadError(f"shape mismatch for {ckpt_name!r}: {e}") from None
            if shard_id is None or whole:
                loaded.add(name)
            else:
                shards.setdefault(name, set()).add(shard_id)
        mark_weights_changed(self)  # a reload in place: graphs read packed copies made before
        return loaded | self._complete_stacked(shards)

    def _complete_stacked(self, shards: dict[str, set]) -> set[str]:
        """The stacked parameters (qkv_proj, gate_up_proj) whose every shard was in the
        checkpoint; WeightLoadError naming the checkpoint tensors that were not (a
        half-loaded parameter would run on uninitialized memory)."""
        missing = []
        for name, got in shards.items():
            for param_part, ckpt_part, sid in self.stacked_params_mapping:
                if param_part in name and sid not in got:
                    missing.append(name.replace(param_part, ckpt_part))
        if missing:
            raise WeightLoadError(
                f"the checkpoint lacks {len(missing)} weight(s) of stacked parameters: "
                + ", ".join(sorted(missing))
            )
        return set(shards)
