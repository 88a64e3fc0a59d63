"""Capability markers that the registry reads from a model class (vLLM's protocols)."""

from __future__ import annotations

from typing import ClassVar, Literal


class SupportsPP:
    """The model can be split into pipeline stages (placeholders + IntermediateTensors)."""

    supports_pp: ClassVar[Literal[True]] = True


class SupportsTP:
    """Every linear layer and the embedding are tensor-parallel."""

    supports_tp: ClassVar[Literal[True]] = True


def supports_pp(cls: type) -> bool:
    return getattr(cls, "supports_pp", False) is True


def supports_tp(cls: type) -> bool:
    return getattr(cls, "supports_tp", False) is True
