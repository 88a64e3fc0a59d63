"""A small pure tensor function compiled by Inductor once per input shape, kept in the
compile cache, and called without Dynamo.

For code outside the model's forward that runs every step (the LM head's GEMV on CPU):
`torch.compile` would re-check its guards on every call and trace again in every new
process; this traces with `make_fx`, compiles with `standalone_compile` and, from the
second process on, only loads.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compilecore.compile_cache import CompileCache, compile_cache_root
from compilecore.config import EngineConfig
from compilecore.inductor_env import trusted_vec_isa
from compilecore.wrapper_codegen import CODEGEN_KEY, recorded_kernel_calls


class StaticShapeFunction:
    def __init__(self, fn: Callable[..., torch.Tensor], engine_config: EngineConfig):
        self.fn, self.config = fn, engine_config
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.source = inspect.getsource(fn)
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        key = tuple((a.shape, a.stride(), a.dtype) for a in args)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = self._compile(args)
        return compiled(*args)[0]

    def _compile(self, args: tuple[torch.Tensor, ...]) -> Callable:
        options = self.config.compilation_config.inductor_options
        factors = {
            "torch": torch.__version__,
            "source": self.source,
            "inputs": [
                [list(a.shape), list(a.stride()), str(a.dtype), a.device.type] for a in args
            ],
            "inductor_options": json.dumps(options, sort_keys=True, default=str),
            "codegen": CODEGEN_KEY,
        }
        digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:24]
        cache = CompileCache(self.config, digest, self.name)
        with trusted_vec_isa(compile_cache_root(self.config)):
            artifact = cache.load("function")
            if artifact is None:
                # A tuple output: fresh and loaded artifacts then both return a sequence.
                graph = make_fx(lambda *a: (self.fn(*a),))(*args)
                with recorded_kernel_calls():  # a CPU graph may record its kernels
                    artifact = torch._inductor.standalone_compile(
                        graph,
                        list(args),
                        dynamic_shapes="from_example_inputs",
                        options={"config_patches": dict(options)},
                    )
                cache.save("function", artifact)
        return artifact

    def __repr__(self) -> str:
        return f"StaticShapeFunction({self.name}, {len(self.compiled)} shapes)"
