"""Architecture name (from `config.json`'s `architectures`) -> model class, loaded lazily,
with the capabilities each class declares."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

from models.interfaces import supports_pp, supports_tp

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("models.qwen2", "Qwen2ForCausalLM"),
}


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    cls: type[nn.Module]
    supports_pp: bool
    supports_tp: bool


class UnknownArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add an out-of-tree model, e.g.
    `register_model("MyForCausalLM", "my_pkg.my_model", "MyForCausalLM")`."""
    _MODELS[architecture] = (module, class_name)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)


def inspect_model(architecture: str) -> ModelInfo:
    cls = resolve_model_class(architecture)
    return ModelInfo(architecture, cls, supports_pp(cls), supports_tp(cls))
