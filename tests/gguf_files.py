"""Small GGUF files for tests, written with gguf-py (llama.cpp's own Python package) the
way llama.cpp's converter writes them: llama.cpp's tensor names, the q and k projections'
rows permuted for its RoPE, each weight quantized with gguf-py's reference quantizer.
Returns the oracle beside the file: the HF model with every weight replaced by gguf-py's
own dequantization of its blocks."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

Q = GGMLQuantizationType

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}  # fmt: skip


def _gguf_name(name: str) -> str:
    module, kind = name.rsplit(".", 1)
    glob = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if module in glob:
        return f"{glob[module]}.{kind}"
    _, _, index, rest = module.split(".", 3)
    return f"blk.{index}.{_LAYER[rest]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's converter's permute
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path: Path, hf_model: torch.nn.Module, types: dict[str, Q], default: Q):
    """`hf_model` (a LlamaForCausalLM) as a GGUF file; every 2-D weight in `default`'s
    blocks, or `types[substring]` where a substring of its HF name matches. Returns the
    oracle: a copy of `hf_model` holding the dequantized weights."""
    config = hf_model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(getattr(config, "rope_theta", None) or 10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    oracle = copy.deepcopy(hf_model)
    state = oracle.state_dict()
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if w.ndim == 2:
            qtype = next((t for key, t in types.items() if key in name), default)
            blocks = quants.quantize(w, qtype)
            state[name].copy_(torch.from_numpy(quants.dequantize(blocks, qtype).copy()))
            leaf = name.rsplit(".", 2)[-2]
            if leaf in heads:  # rows of blocks are rows of the weight
                blocks = _permute(blocks, heads[leaf])
            writer.add_tensor(_gguf_name(name), blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return oracle
