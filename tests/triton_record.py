"""A pytest plugin (`-p tests.triton_record`) that writes every Triton kernel
specialization the interpreter launched to the JSON file named by
COMPILECORE_TRITON_RECORD: the kernel's module and name, each argument's Triton type (or
a constexpr's value) and the launch options. tests/test_triton_compiles.py compiles them
for a GPU that is not here."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import torch

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
          torch.uint8: "u8", torch.bool: "i1"}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages")
_seen: dict[str, dict] = {}


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _constexpr(value):
    """A constexpr as JSON: a Triton dtype by its name, tagged (tests/triton_compile.py)."""
    import triton.language as tl

    return {"tl.dtype": value.name} if isinstance(value, tl.dtype) else value


def _record(fn, args: tuple, kwargs: dict) -> None:
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = {}, {}
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            signature[name], constexprs[name] = "constexpr", _constexpr(value)
        else:
            signature[name] = "constexpr" if value is None else _type(value)
            if value is None:
                constexprs[name] = None
    options = {k: kwargs[k] for k in _OPTIONS if kwargs.get(k) is not None}
    spec = {"module": fn.__module__, "name": fn.__name__, "signature": signature,
            "constexprs": constexprs, "options": options}  # fmt: skip
    _seen[json.dumps(spec, sort_keys=True, default=str)] = spec


def pytest_configure(config) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        _record(self.fn, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def pytest_unconfigure(config) -> None:
    path = os.environ.get("COMPILECORE_TRITON_RECORD")
    if not path:
        return
    if os.path.exists(path):  # an earlier run's, kept: runs add to one file
        for spec in json.loads(Path(path).read_text()):
            _seen.setdefault(json.dumps(spec, sort_keys=True, default=str), spec)
    with open(path, "w") as f:
        json.dump(list(_seen.values()), f, indent=1, default=str)
