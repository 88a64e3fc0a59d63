"""Per-step data that layers outside the compiled graph (attention) look up by name.

The compiled graph cannot carry Python objects such as block tables, so the runner sets
a forward context around each model call and the attention op reads it from here. One
per thread: two engines stepping on two threads each read their own step's metadata.
"""

from __future__ import annotations

import threading
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


_local = threading.local()  # .context: this thread's ForwardContext


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError(
            "no forward context is set: call the model inside "
            "compilecore.forward_context.set_forward_context(...)"
        )
    return context


def is_forward_context_available() -> bool:
    return getattr(_local, "context", None) is not None


@contextmanager
def set_forward_context(
    attn_metadata: Any, engine_config: Any, **extras: Any
) -> Iterator[ForwardContext]:
    prev = getattr(_local, "context", None)
    _local.context = context = ForwardContext(
        no_compile_layers=engine_config.compilation_config.static_forward_context,
        attn_metadata=attn_metadata,
        extras=extras,
    )
    try:
        yield context
    finally:
        _local.context = prev
