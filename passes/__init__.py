"""FX/Inductor passes and the fused custom ops they emit.

The public API for user-written passes (see docs/passes.md, "Write a pass"):
`passes.GraphPass`, `passes.PatternPass` and `passes.as_pass`.
"""

from typing import Any

_PUBLIC = {"GraphPass", "PatternPass", "FunctionPass", "as_pass"}


def __getattr__(name: str) -> Any:
    # Lazy: importing Inductor's pattern matcher costs a second that `passes.config` and
    # the CLI's start-up should not pay.
    if name in _PUBLIC:
        from passes import base

        return getattr(base, name)
    raise AttributeError(f"module 'passes' has no attribute {name!r}")
