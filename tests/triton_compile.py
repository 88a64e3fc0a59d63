"""Compiles the Triton kernel specializations in a JSON file (tests/triton_record.py)
for a CUDA target with Triton's own compiler, no GPU needed: `python -m
tests.triton_compile FILE [ARCH]`. Prints one line per failure and exits 1 if any."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _constexpr(value):
    """tests/triton_record.py's JSON of a constexpr, back to its value."""
    return tl.dtype(value["tl.dtype"]) if isinstance(value, dict) else value


def compile_spec(spec: dict, arch: int) -> None:
    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    constexprs = {name: _constexpr(v) for name, v in spec["constexprs"].items()}
    source = ASTSource(kernel, spec["signature"], constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options=spec["options"])


def main(path: str, arch: int = 90) -> int:
    failed = 0
    for spec in json.loads(Path(path).read_text()):
        try:
            compile_spec(spec, arch)
        except Exception as exc:  # each failure named, then the next
            failed += 1
            print(f"{spec['module']}.{spec['name']} {spec['constexprs']}: "
                  f"{type(exc).__name__}: {str(exc)[-1500:]}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *map(int, sys.argv[2:3])))
