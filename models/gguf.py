"""GGUF files (llama.cpp's format): the model's config and tokenizer, and its tensors with
the Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS blocks kept (the K-quants' scales
as stored; Q5_K's where our CPU kernels read its 5 bits, `keeps_q5_k`; the IQ4s' on CPU).

Config and tokenizer come from transformers' GGUF reader, which takes ~10 s for a small
model, so they are written once into a folder under the cache (`metadata_dir`) keyed by
the file's path, size and time; the weights are read from the file on every load.

Tensor names follow llama.cpp's (`blk.0.attn_q.weight`) and map to HF's; llama.cpp's
converter permutes the rows of Llama's q and k projections (its RoPE pairs neighbours,
HF's pairs halves), which `_unpermute` reverses, on the blocks as on float tensors (a
row of blocks is a row of the weight). Other block types (Q5_0, IQ3_S, ...) are
dequantized to fp32 when loaded, with a warning naming them; so is a fused module (QKV,
gate/up) with a part in such a type, with a warning. A fused module whose parts are
kept in different types (Q4_K_M's Q4_K q and k beside a Q6_K v) holds each part apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.cache_files import write_folder_once
from models.gguf_file import GGUFFile, GGUFFormatError
from models.layers.quantization import QuantFormat, QuantizationConfig
from passes.ops.quantized import int8_pairs, kernel_path, pack_q5, pack_q6

logger = logging.getLogger("compilecore")

# llama.cpp's tensor names -> HF's (`{}`: the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}  # fmt: skip
# HF's fused modules (models/llama.py) and the checkpoint modules they hold.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SKIPPED = ("rope_freqs.weight",)  # llama.cpp's precomputed RoPE factors: we compute ours


class GGUFError(ValueError):
    pass


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None when unknown."""
    module, _, kind = name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{kind}"
    return None


def _reader(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except GGUFFormatError as e:
        hint = " (is it truncated?)" if e.truncated else ""
        raise GGUFError(f"cannot read {path} as a GGUF file: {e}{hint}") from e


def keeps_q5_k(device_type: str) -> bool:
    """Whether Q5_K blocks are kept: where our CPU kernels read its 5-bit values in place
    (the exact bf16 row products with AVX512-BF16; with AVX2 the row products on int8
    activations, `int8_pairs`). Elsewhere (other CPUs, GPUs: the Triton product reads no
    5-bit rows) they load as floats, as every type not kept."""
    return device_type == "cpu" and (kernel_path() == "bf16" or int8_pairs())


def _kept_formats(q5_k: bool = True, iq4: bool = True) -> dict[Any, QuantFormat]:
    """The block types kept as stored (`q5_k`, `iq4`: Q5_K's, IQ4_NL's and IQ4_XS's
    too; off the CPU the Triton products read neither)."""
    from gguf import GGMLQuantizationType as T

    kept = {T.Q8_0: QuantFormat(8, 32), T.Q4_0: QuantFormat(4, 32), T.Q4_1: QuantFormat(4, 32),
            T.Q4_K: QuantFormat(4, 32, torch.uint8),
            T.Q6_K: QuantFormat(6, 16, torch.int8)}  # fmt: skip
    if q5_k:
        kept[T.Q5_K] = QuantFormat(5, 32, torch.uint8)
    if iq4:
        kept[T.IQ4_NL] = kept[T.IQ4_XS] = QuantFormat(4, 32, torch.float32, table=True)
    return kept


def _kept_by(config: QuantizationConfig | None) -> dict[Any, QuantFormat]:
    """The block types a file's config keeps (Q5_K's, IQ4's only where it holds one)."""
    held = [] if config is None else [*config.formats.values(), *sum(config.parts.values(), ())]
    return _kept_formats(any(f.bits == 5 for f in held), any(f.table for f in held))


def _dense_types() -> set[Any]:
    from gguf import GGMLQuantizationType as T

    return {T.F32, T.F16, T.BF16}


def quant_config(path: str | Path, device_type: str = "cpu") -> QuantizationConfig:
    """Which layers keep their blocks: each whose tensors (all parts of a fused module)
    share one kept block type, and fused modules whose parts are each in a kept type
    (held per part). Float tensors, and fused modules with a part in another type, load
    as floats. `device_type`: where the model runs (`keeps_q5_k`)."""
    kept = _kept_formats(keeps_q5_k(device_type), device_type == "cpu")
    by_module: dict[str, QuantFormat | None] = {}
    for tensor in _reader(Path(path)).tensors:
        name = hf_name(tensor.name)
        if name is None or not name.endswith(".weight"):
            continue
        by_module[name[: -len(".weight")]] = kept.get(tensor.tensor_type)
    formats: dict[str, QuantFormat] = {}
    parts: dict[str, tuple[QuantFormat, ...]] = {}
    for module, fmt in by_module.items():
        parent, _, leaf = module.rpartition(".")
        fused = next((f for f, members in _FUSED.items() if leaf in members), None)
        if fused is None:
            if fmt is not None:
                formats[module] = fmt
            continue
        each = tuple(by_module.get(f"{parent}.{p}") for p in _FUSED[fused])
        if len(set(each)) == 1 and fmt is not None:
            formats[f"{parent}.{fused}"] = fmt
        elif None not in each:  # every part kept, in different formats: held apart
            parts[f"{parent}.{fused}"] = each
    return QuantizationConfig("gguf", formats=formats, parts=parts)


def _fused_name(name: str) -> str:
    """`...self_attn.v_proj.weight` -> `...self_attn.qkv_proj` (the module that holds it)."""
    parent, dot, leaf = name.rsplit(".", 1)[0].rpartition(".")
    fused = next((f for f, parts in _FUSED.items() if leaf in parts), leaf)
    return f"{parent}{dot}{fused}"


def _module_format(name: str, config: QuantizationConfig, type_: Any) -> QuantFormat | None:
    """The format a tensor's blocks are kept in (None: loaded as floats)."""
    module = _fused_name(name)
    if module in config.parts:  # a part held apart: its own block type
        return _kept_by(config).get(type_)
    return config.formats.get(module)


def _blocks(raw: torch.Tensor, type_: Any) -> dict[str, torch.Tensor]:
    """One tensor's GGUF blocks [rows, bytes] as our format's fields."""
    from gguf import GGMLQuantizationType as T

    if type_ == T.Q4_K:
        return _q4_k_blocks(raw)
    if type_ == T.Q6_K:
        return _q6_k_blocks(raw)
    if type_ == T.Q5_K:
        return _q5_k_blocks(raw)
    if type_ in (T.IQ4_NL, T.IQ4_XS):
        return _iq4_blocks(raw, type_ == T.IQ4_XS)
    size = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20}[type_]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)

    def half(at: int) -> torch.Tensor:
        return blocks[:, :, at : at + 2].contiguous().view(torch.float16).reshape(rows, -1)

    scales = half(0)
    if type_ == T.Q8_0:
        return {"qweight": blocks[:, :, 2:].contiguous().view(torch.int8).reshape(rows, -1),
                "scales": scales}  # fmt: skip
    start, mins = (4, half(2)) if type_ == T.Q4_1 else (2, (-8 * scales.float()).half())
    return {"qweight": blocks[:, :, start:].reshape(rows, -1).contiguous(), "scales": scales,
            "mins": mins}  # fmt: skip


def _halves(b: torch.Tensor) -> torch.Tensor:
    """fp16 values from their little-endian byte pairs (uint8 [..., 2]) as fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _k4_scales(b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q4_K's and Q5_K's scales and mins (a super-block's first 16 bytes: d, dmin fp16; 12
    bytes of 6-bit scales and mins for 8 runs of 32) compact: per row the 6-bit sc, m as
    bytes, then d and -dmin as fp32 (scale d x sc and min -dmin x m, exact)."""
    rows = b.shape[0]
    d, dmin = _halves(b[..., 0:2]), _halves(b[..., 2:4])
    q = b[..., 4:16].long()  # llama.cpp's get_scale_min_k4
    sc = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)

    def compact(sub: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
        return torch.cat([sub.to(torch.uint8).reshape(rows, -1),
                          sup.contiguous().view(torch.uint8).reshape(rows, -1)], -1)  # fmt: skip

    return {"scales": compact(sc, d), "mins": compact(m, -dmin)}


def _k4_runs(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of nibbles a super-block (each 64-value chunk a run in the low nibbles
    and the next in the high ones) as runs [rows, super-blocks, 8, 32] of 4-bit values."""
    qs = qs.reshape(*qs.shape[:2], 4, 32)
    return torch.stack([qs & 15, qs >> 4], dim=3).reshape(*qs.shape[:2], 8, 32)


def _q4_k_blocks(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q4_K super-blocks (256 values, 144 bytes: 16 of scales, 128 of nibbles) as our q4
    fields: scales and mins compact (`_k4_scales`), nibbles in our per-run order."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 144)
    runs = _k4_runs(b[..., 16:]).reshape(rows, -1, 32)  # [rows, runs, 32]
    packed = runs[..., :16] | (runs[..., 16:] << 4)
    return {"qweight": packed.reshape(rows, -1).contiguous(), **_k4_scales(b)}


def _q5_k_blocks(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q5_K super-blocks (256 values, 176 bytes: 16 of scales as Q4_K's, 32 of fifth bits,
    run r's value l's in bit r of byte l, 128 of nibbles as Q4_K's) as q4 fields with the
    values in 5 bits (`pack_q5`: 200 bytes a super-block with the compact scales)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 176)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(8, 1)
    fifth = (b[..., 16:48].unsqueeze(-2) >> shifts) & 1  # [rows, super-blocks, run, l]
    u = _k4_runs(b[..., 48:]) | (fifth << 4)
    return {"qweight": pack_q5(u.reshape(rows, -1)), **_k4_scales(b)}


def _q6_k_blocks(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q6_K super-blocks (256 values, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit
    highs, 16 int8 scales for runs of 16, d fp16) as our q8 fields in groups of 16: the
    values q - 32 kept in 6 bits (`pack_q6`: 216 bytes a super-block with the scales) and
    the scales as stored (compact: per row the int8 sc, then each super-block's d as fp32
    bytes; scale d x sc, exact)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 210)
    ql = b[..., :128].reshape(rows, -1, 2, 2, 32)  # [.., half, low 32 / high 32, l]
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    lo = torch.cat([ql & 15, ql >> 4], dim=3)  # value runs 0, 1, 2, 3 of each half
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3
    q = (lo | (hi << 4)).to(torch.int8) - 32
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)
    d = _halves(b[..., 208:210]).contiguous().view(torch.int8).reshape(rows, -1)
    return {"qweight": pack_q6(q.reshape(rows, -1)), "scales": torch.cat([sc, d], -1)}


def _iq4_blocks(raw: torch.Tensor, xs: bool) -> dict[str, torch.Tensor]:
    """IQ4_NL blocks (32 values, 18 bytes: d fp16, 16 bytes of 4-bit indices in q4's order)
    or IQ4_XS super-blocks (256 values, 136 bytes: d fp16, the 6-bit sub-block scales' top
    bits as a uint16 and their low nibbles in 4 bytes, 128 bytes of indices) as q8 fields
    of indices into IQ4_NL's table, with fp32 scales a run of 32 (d, or d x (ls - 32):
    exact); 4.5 and 5 bits a value where GGUF's take 4.5 and 4.25."""
    rows = raw.shape[0]
    if not xs:
        b = raw.reshape(rows, -1, 18)
        return {"qweight": b[..., 2:].reshape(rows, -1).contiguous(),
                "scales": _halves(b[..., 0:2]).reshape(rows, -1)}  # fmt: skip
    b = raw.reshape(rows, -1, 136)
    d = _halves(b[..., 0:2])
    high = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [rows, sb, 1]
    run = torch.arange(8)
    ls = ((b[..., 4:8].repeat_interleave(2, -1).to(torch.int32) >> (4 * (run % 2))) & 15) | (
        ((high >> (2 * run)) & 3) << 4
    )
    scales = (d.unsqueeze(-1) * (ls - 32).float()).reshape(rows, -1)
    return {"qweight": b[..., 8:].reshape(rows, -1).contiguous(), "scales": scales}


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Reverse llama.cpp's row permutation of a q or k projection (or its blocks)."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def iterate_weights(
    path: str | Path, hf_config: Any, config: QuantizationConfig | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file: a kept layer's as its fields
    (`...q_proj.qweight`, `.scales`, `.mins`), every other one as floats."""
    from gguf import quants

    reader = _reader(Path(path))
    arch = reader.field("general.architecture")
    heads = {"q_proj": hf_config.num_attention_heads,
             "k_proj": getattr(hf_config, "num_key_value_heads", None)
             or hf_config.num_attention_heads}  # fmt: skip
    dense, dequantized, mixed, kept = _dense_types(), set(), set(), _kept_by(config)
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED:
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise GGUFError(f"{path}: tensor {tensor.name!r} has no counterpart in our Llama")
        fmt = _module_format(name, config, tensor.tensor_type) if config is not None else None
        if fmt is not None:
            fields = _blocks(torch.from_numpy(np.array(tensor.data)), tensor.tensor_type)
        else:
            if tensor.tensor_type not in dense and tensor.tensor_type not in kept:
                dequantized.add(tensor.tensor_type.name)
            elif config is not None and tensor.tensor_type in kept:
                mixed.add(_fused_name(name))  # a fused module with a part not kept
            values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            fields = {"weight": torch.from_numpy(np.array(values, dtype=np.float32))}
        leaf = name.rsplit(".", 2)[-2]
        if arch == "llama" and leaf in heads and name.endswith(".weight"):
            fields = {k: _unpermute(v, heads[leaf]) for k, v in fields.items()}
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        for key, value in fields.items():
            yield (f"{base}.{key}" if base else name), value
    if dequantized:
        logger.warning("%s: %s blocks are dequantized to floats when loaded (kept as stored: "
                       "%s)", path, ", ".join(sorted(dequantized)),
                       ", ".join(t.name for t in kept))  # fmt: skip
    if mixed:
        logger.warning("%s: %d fused modules (%s, ...) hold a part in a block type not kept and "
                       "load as floats", path, len(mixed), sorted(mixed)[0])  # fmt: skip


def metadata_dir(path: str | Path) -> Path:
    """A folder with the file's config.json and tokenizer (HF's files), written once."""
    from compilecore.config import cache_root

    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{path.stem}-{key}"
    return write_folder_once(target, lambda out: _write_metadata(path, out), "config.json")


def _write_metadata(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, OSError, KeyError) as e:
        raise GGUFError(f"cannot read the model's config from {path}: {e}") from e
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    if _reader(path).field("tokenizer.ggml.model") is not None:  # else: pass tokenizer=
        try:
            AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))
        except (ValueError, OSError, KeyError) as e:
            raise GGUFError(f"cannot read the tokenizer of {path}: {e}") from e
    data = json.loads((out / "config.json").read_text())
    # Tied exactly when the file has no head of its own (llama-quantize writes one, often in
    # another block type, even for a model trained with tied embeddings).
    data["tie_word_embeddings"] = not any(t.name == "output.weight" for t in _reader(path).tensors)
    data.pop("torch_dtype", None)
    data.pop("quantization_config", None)
    # Activations run in bf16 by default (the products' integer path; dtype= overrides).
    data["dtype"] = "bfloat16"
    if not data.get("architectures"):
        data["architectures"] = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
