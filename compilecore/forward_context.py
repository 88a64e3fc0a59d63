"""Per-step data that layers outside the compiled graph (attention) look up by name.

The compiled graph cannot carry Python objects such as block tables, so the runner sets
a forward context around each model call and the attention op reads it from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardContext:
    # prefix -> attention layer (the static registry of the model's config)
    no_compile_layers: dict[str, Any]
    # backend-specific metadata for this step (None while profiling/tracing)
    attn_metadata: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError(
            "no forward context is set: call the model inside "
            "compilecore.forward_context.set_forward_context(...)"
        )
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextmanager
def set_forward_context(
    attn_metadata: Any, engine_config: Any, **extras: Any
) -> Iterator[ForwardContext]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(
        no_compile_layers=engine_config.compilation_config.static_forward_context,
        attn_metadata=attn_metadata,
        extras=extras,
    )
    try:
        yield _forward_context
    finally:
        _forward_context = prev
