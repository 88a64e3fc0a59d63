"""Small GGUF files for tests, written with gguf-py (llama.cpp's own Python package) the
way llama.cpp's converter writes them: llama.cpp's tensor names, the q and k projections'
rows permuted for its RoPE, each weight quantized with gguf-py's reference quantizer
(ours for the K-quants and IQ4s, which it lacks).
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


def _quantize_q4_k(w: np.ndarray, top: int = 15) -> np.ndarray:
    """Q4_K blocks of w [rows, 256 n] (gguf-py quantizes no K-quant): per run of 32 a scale
    (max - min) / 15 and a min, both as 6-bit multiples of the super-block's d and dmin;
    packed in llama.cpp's layout (d, dmin, 12 bytes of 6-bit scales and mins, nibbles).
    `top` 31: Q5_K's, its fifth bits in 32 bytes between scales and nibbles (bit r of
    byte l: run r's value l)."""
    x = w.reshape(w.shape[0], -1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, minus = (hi - lo) / top, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minus.max(-1) / 63).astype(np.float16)
    df, dminf = np.maximum(d.astype(np.float32), 1e-8), np.maximum(dmin.astype(np.float32), 1e-8)
    sc = np.clip(np.rint(scale / df[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(minus / dminf[..., None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    off = (dmin.astype(np.float32)[..., None] * m)[..., None]
    q = np.clip(np.rint((x + off) / np.maximum(step, 1e-8)), 0, top).astype(np.uint8)
    packed = np.zeros((*sc.shape[:2], 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    head = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)], -1)
    parts = [head, packed]
    if top == 31:  # [.., run r, l] -> byte l's bit r
        parts.append(sum(((q[..., r, :] >> 4) & 1) << r for r in range(8)).astype(np.uint8))
    q = (q & 15).reshape(*sc.shape[:2], 4, 2, 32)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*sc.shape[:2], 128)
    return np.concatenate([*parts, qs], -1).reshape(w.shape[0], -1)


def _quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of w [rows, 256 n]: per run of 16 an int8 multiple of the super-block's
    d, values in [-32, 31]; llama.cpp's layout (low nibbles, 2-bit highs, scales, d)."""
    x = w.reshape(w.shape[0], -1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / np.maximum(d.astype(np.float32), 1e-8)[..., None]), 1, 127)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = (np.clip(np.rint(x / np.maximum(step, 1e-8)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(*sc.shape[:2], 2, 4, 32)  # [.., half, run of 32 (value l + 32 k), l]
    ql = np.concatenate([q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4,
                         q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4], -1)  # fmt: skip
    qh = sum(((q[..., k, :] >> 4) & 3) << (2 * k) for k in range(4)).astype(np.uint8)
    blocks = [ql.reshape(*sc.shape[:2], 128), qh.reshape(*sc.shape[:2], 64),
              sc.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8)]  # fmt: skip
    return np.concatenate(blocks, -1).reshape(w.shape[0], -1)


def _quantize_iq4(w: np.ndarray, xs: bool) -> np.ndarray:
    """IQ4_NL blocks of w [rows, 32 n] (d = max |x| / 127 a block, the nearest of the 16
    values a value) or IQ4_XS super-blocks [rows, 256 n] (a 6-bit scale ls - 32 a run of
    32 as a multiple of the super-block's d); llama.cpp's layouts."""
    table = np.array(quants.IQ4_NL.kvalues, dtype=np.float32)
    x = w.reshape(w.shape[0], -1, 8 if xs else 1, 32).astype(np.float32)
    step = np.abs(x).max(-1) / 127  # [rows, blocks, runs]
    if xs:
        d = (step.max(-1) / 31).astype(np.float16)
        ls = np.clip(np.rint(step / np.maximum(d.astype(np.float32), 1e-8)[..., None]), 1, 31)
        ls = ls.astype(np.int32) + 32
        step = d.astype(np.float32)[..., None] * (ls - 32)
    else:
        d = step[..., 0].astype(np.float16)
        step = d.astype(np.float32)[..., None]
    idx = np.abs(x[..., None] / np.maximum(step, 1e-8)[..., None, None] - table).argmin(-1)
    qs = (idx[..., :16] | (idx[..., 16:] << 4)).astype(np.uint8).reshape(*x.shape[:2], -1)
    parts = [d[..., None].view(np.uint8)]
    if xs:
        high = sum(((ls[..., r] >> 4) & 3) << (2 * r) for r in range(8)).astype(np.uint16)
        low = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)
        parts += [high[..., None].view(np.uint8), low.astype(np.uint8)]
    return np.concatenate([*parts, qs], -1).reshape(w.shape[0], -1)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """GGUF blocks of w: gguf-py's quantizer, or ours for the K-quants and IQ4s it lacks."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        return _quantize_q4_k(w, 15 if qtype == Q.Q4_K else 31)
    if qtype == Q.Q6_K:
        return _quantize_q6_k(w)
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):
        return _quantize_iq4(w, qtype == Q.IQ4_XS)
    return quants.quantize(w, qtype)


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
            blocks = quantize(w, qtype)
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
