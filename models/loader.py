"""Loading a model from a HF model folder: `config.json` plus one or many safetensors
files, streamed tensor by tensor so that a rank never holds more than its slice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from compilecore.config import EngineConfig
from models import gguf
from models.layers.quantization import unpack_6bit_values
from models.registry import resolve_model_class

INDEX_FILE = "model.safetensors.index.json"


class ModelLoadError(ValueError):
    pass


def load_hf_config(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The folder's config.json. `trust_remote_code` lets transformers run a config class
    shipped in the folder (vLLM's flag); the model itself must still be one of ours."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {str(path)!r}: is this a HF model folder?")
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e


def checkpoint_dtype(hf_config: Any) -> Any:
    return getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"cannot read the shard index {index}: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards named in {index} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {str(path)!r} (only safetensors checkpoints are supported)"
        )
    return files


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelLoadError(
                f"cannot read {file}: {e} (is the file corrupt or truncated?)"
            ) from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"cannot read tensor {name!r} from {file}: {e}") from e
                yield name, tensor


def build_model(engine_config: EngineConfig) -> nn.Module:
    """The model for this rank, with uninitialised parameters, on the config's device."""
    model_config = engine_config.model_config
    cls = resolve_model_class(model_config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(engine_config.device):
            return cls(engine_config=engine_config, prefix="").eval()
    finally:
        torch.set_default_dtype(previous)


def load_weights(
    model: nn.Module, model_dir: str | Path, engine_config: EngineConfig | None = None
) -> None:
    """Load a folder's safetensors (or a GGUF file's tensors) into `model`, then let each
    layer finish its weights (quantize them where the config asks for it at load)."""
    if gguf.is_gguf(model_dir):
        hf_config = engine_config.model_config.hf_config if engine_config else None
        quant = engine_config.model_config.quant_config if engine_config else None
        weights = gguf.iterate_weights(model_dir, hf_config or model.config, quant)
    else:
        weights = iterate_weights(safetensors_files(model_dir))
    loaded = model.load_weights(weights)
    expected = set(dict(model.named_parameters()))
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        raise ModelLoadError(f"weights missing from the checkpoint in {model_dir}: {shown}")
    for module in model.modules():
        finish = getattr(module, "process_weights_after_loading", None)
        if finish is not None:
            finish()
    unpack_6bit_values(model)  # the CPU's 6-bit layout: other devices read int8


def load_model(engine_config: EngineConfig) -> nn.Module:
    model = build_model(engine_config)
    load_weights(model, engine_config.model_config.model, engine_config)
    return model
