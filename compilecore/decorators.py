"""`@support_torch_compile`: trace a module's `forward` once, then run the compiled code.

The first call marks the token dimension of the inputs as dynamic (unbacked, so that a
batch of one token does not specialise the graph), traces `forward` with
`fullgraph=True` and hands the graph to our backend. Dynamo's result is a new bytecode
for `forward`; later calls run that bytecode directly, with **no guard evaluation and no
recompilation**. That is a deliberate contract: a compiled model must not branch on the
number of tokens or on anything else that changes between steps (the attention op, which
reads per-step metadata, is outside the compiled pieces). `compilation_config.debug=True`
keeps Dynamo's guards instead and raises on any recompile.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import re
import time
import types
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from compilecore.backend import CompilecoreBackend
from compilecore.compile_cache import (
    cache_disabled,
    compile_cache_root,
    config_factors,
    file_digest,
)
from compilecore.config import EngineConfig
from compilecore.counters import compilation_counter
from compilecore.dump import dump_root, write_report, write_transformed_code
from compilecore.inductor_env import trusted_vec_isa
from compilecore.recipe import (
    ForwardRecipe,
    NoRecipe,
    RecipeRunner,
    args_structure,
    describe_output,
    module_fingerprint,
    recipe_path,
)
from passes.config import AttentionShape, PassContext
from passes.manager import PostGradPassManager

logger = logging.getLogger("compilecore")
T = TypeVar("T", bound=type[nn.Module])

_capturing_code: dict[types.CodeType, types.CodeType] = {}


def _bytecode_hook(old_code: types.CodeType, new_code: types.CodeType) -> None:
    if old_code in _capturing_code:
        _capturing_code[old_code] = new_code


torch._dynamo.convert_frame.register_bytecode_hook(_bytecode_hook)


def _default_dynamic_dims(forward: Callable) -> dict[str, int]:
    dims = {}
    for name, p in inspect.signature(forward).parameters.items():
        # Tensor, Tensor | None, IntermediateTensors | None (strings under PEP 563)
        if "Tensor" in str(p.annotation):
            dims[name] = 0
    return dims


def _with_code(function: types.FunctionType, code: types.CodeType) -> types.FunctionType:
    new = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__)
    new.__kwdefaults__ = function.__kwdefaults__
    return new


_HINT_OVERRIDE = (
    "hint_override" in inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters
)


def _mark_unbacked(value: Any, dims: int | list[int], hint: int) -> None:
    """Unbacked, with `hint` as the size Inductor tunes the symbolic-size code for (it
    would otherwise assume its fallback of 8192 tokens)."""
    dims = [dims] if isinstance(dims, int) else list(dims)
    kwargs = {"hint_override": hint} if _HINT_OVERRIDE else {}
    if isinstance(value, torch.Tensor):
        for d in dims:
            torch._dynamo.decorators.mark_unbacked(value, d, **kwargs)
    elif hasattr(value, "tensors"):  # IntermediateTensors
        for t in value.tensors.values():
            _mark_unbacked(t, dims, hint)


def pass_context(engine_config: EngineConfig, tag: str) -> PassContext:
    """What the passes need to know about the model: the attention layers' shapes (from
    the layers registered so far) and the tensor-parallel group."""
    from compilecore.parallel_state import get_tp_group

    layers = engine_config.compilation_config.static_forward_context.values()
    shapes = sorted(
        {AttentionShape(a.num_heads, a.num_kv_heads, a.head_size) for a in layers},
        key=lambda s: (s.num_heads, s.num_kv_heads, s.head_dim),
    )
    tp = get_tp_group()
    root = dump_root(engine_config)
    return PassContext(
        device_type=engine_config.device.type,
        attention_shapes=shapes,
        tp_size=tp.world_size,
        tp_group_name=tp.group.group_name if tp.group is not None else None,
        dump_dir=str(root / tag / "passes") if root else None,
    )


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every CompiledForward, for the exit hook


@atexit.register
def _release_compiled_code() -> None:
    """Drop the compiled code objects while the interpreter is still whole. Dynamo hangs
    a clean-up hook on each; left to the interpreter's teardown, the hook runs after
    torch's module globals are gone and prints "Exception ignored ... 'NoneType' object
    has no attribute 'pop'" at the exit of every script that compiled a model."""
    for forward in list(_LIVE):
        forward.compiled_code = forward.dispatch = forward.dynamo_fn = None
        forward.function = None
    gc.collect()


class DataDependentShapeError(RuntimeError):
    """The traced forward depends on the (unbacked) token count."""


def _is_data_dependent(exc: BaseException) -> bool:
    """Dynamo's ways of saying that code needed the value of an unbacked size (u0, u1...).
    Not a failure inside the compile backend (a pass, a fake implementation, Inductor):
    those messages name the pieces' arguments, sizes u0 and u1 among them, whatever the
    error was, and are raised as they are."""
    text = f"{type(exc).__name__}: {exc}"
    markers = ("data-dependent", "DataDependent", "GuardOnDataDependentSymNode")
    if any(m in text for m in markers):
        return True
    in_backend = "While executing" in text or type(exc).__name__ in (
        "BackendCompilerFailed", "InductorError",
    )  # fmt: skip
    return not in_backend and re.search(r"\bu\d+\b", text) is not None


class CompiledForward:
    """Compile state of one module instance."""

    def __init__(
        self, module: nn.Module, engine_config: EngineConfig, dynamic_dims: dict[str, Any]
    ):
        self.config = engine_config
        self.dynamic_dims = dynamic_dims
        forward = type(module).forward
        self.signature = inspect.signature(forward)
        # A private copy of forward's code: Dynamo caches per code object, so every
        # instance gets its own trace instead of a growing chain of guarded entries.
        self.function = _with_code(forward, forward.__code__.replace())
        prefix = getattr(module, "prefix", "")
        tag = self.tag = type(module).__name__ + (f".{prefix}" if prefix else "")
        cc = engine_config.compilation_config
        self.pass_manager = PostGradPassManager(
            cc.passes, pass_context(engine_config, tag), custom_passes=cc.custom_passes
        )
        self.backend = CompilecoreBackend(engine_config, tag, self.pass_manager)
        self.compiled_code: types.CodeType | None = None
        self.dispatch: types.FunctionType | None = None
        self.dynamo_fn: Callable | None = None
        _LIVE.add(self)

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.dispatch is not None:
            return self.dispatch(module, *args, **kwargs)
        if self.dynamo_fn is not None:  # debug mode: through Dynamo, guards on
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.dynamo_fn(module, *args, **kwargs)
        path = self._recipe_path(module, args, kwargs)
        with trusted_vec_isa(compile_cache_root(self.config)):
            if path is not None and self._warm_start(module, path):
                return self.dispatch(module, *args, **kwargs)
            return self._compile_and_run(module, path, *args, **kwargs)

    def _recipe_path(self, module: nn.Module, args: tuple, kwargs: dict):
        """Where this forward's recipe lives; None when recipes are off (debug mode, dumps,
        the verifier or a disabled cache: those must trace)."""
        cc = self.config.compilation_config
        if cc.debug or cache_disabled() or self.backend.must_run_passes:
            return None
        factors = config_factors(self.config, self.pass_manager.uuid())
        factors["module"] = f"{type(module).__module__}.{type(module).__qualname__}"
        factors["module_fingerprint"] = module_fingerprint(module)
        factors["args"] = args_structure(self.signature, args, kwargs)
        return recipe_path(compile_cache_root(self.config), self.tag, factors)

    def _warm_start(self, module: nn.Module, path) -> bool:
        recipe = ForwardRecipe.load(path)
        try:
            stitched = self.backend.load_recipe(recipe) if recipe is not None else None
            if stitched is not None:
                runner = RecipeRunner(recipe, module, stitched, self.function)
        except (KeyError, IndexError, TypeError, AttributeError, SyntaxError) as e:
            # A damaged recipe that parsed: trace as if there were none.
            logger.warning("forward recipe %s does not fit this model (%r): tracing again", path, e)
            return False
        if stitched is None:
            return False
        compilation_counter.num_models_seen += 1
        compilation_counter.num_warm_starts += 1
        self.dispatch = runner
        return True

    def _compile_and_run(self, module: nn.Module, path, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(module, *args, **kwargs)
        # The symbolic-size code serves prefill chunks up to the scheduler's token budget.
        hint = self.config.scheduler_config.max_num_batched_tokens
        for name, dims in self.dynamic_dims.items():
            if bound.arguments.get(name) is not None:
                _mark_unbacked(bound.arguments[name], dims, hint)
        compilation_counter.num_models_seen += 1
        self.dynamo_fn = torch.compile(
            self.function, fullgraph=True, backend=self.backend, dynamic=False
        )
        code = self.function.__code__
        _capturing_code[code] = None
        self.backend.trace_start = time.perf_counter()
        try:
            out = self.dynamo_fn(module, *args, **kwargs)
        except Exception as exc:
            if _is_data_dependent(exc):
                raise DataDependentShapeError(
                    f"{self.tag}.forward branches on (or specializes to) the number of tokens, "
                    "which compilecore traces as one size for every batch: the rule is that a "
                    "model's forward may not depend on the token count in Python (use tensor "
                    "ops instead); compilation_config={'debug': True} keeps Dynamo's guards to "
                    f"find the line. Dynamo said: {str(exc).splitlines()[0][:300]}"
                ) from exc
            raise
        finally:
            self.compiled_code = _capturing_code.pop(code, None)
        root = dump_root(self.config)
        if root is not None and self.compiled_code is not None:
            write_transformed_code(root / self.tag, self.compiled_code)
            write_report(root, self.tag, self.backend)
        if not self.config.compilation_config.debug:
            if self.compiled_code is None:
                raise RuntimeError("torch.compile produced no bytecode for forward")
            self.dispatch = self._recipe_runner(module, out, path) or _with_code(
                self.function, self.compiled_code
            )
        return out

    def _recipe_runner(self, module: nn.Module, out: Any, path) -> RecipeRunner | None:
        """Write down what Dynamo's bytecode does, save it for the next process, and run
        it from now on; None (keep Dynamo's bytecode) if the forward is not expressible."""
        backend = self.backend
        try:
            if isinstance(backend.input_sources, NoRecipe):
                raise backend.input_sources
            split_code, pieces = backend.recipe_parts()
            recipe = ForwardRecipe(
                cache_key=backend.cache_key,
                traced_files={f: file_digest(f) for f in backend.traced_files},
                inputs=backend.input_sources,
                output=describe_output(out, backend.first.outputs),
                split_code=split_code,
                pieces=pieces,
            )
        except NoRecipe as e:
            logger.info("%s runs Dynamo's bytecode (no recipe: %s)", self.tag, e)
            return None
        finally:
            backend.first.outputs = None
        if path is not None:
            recipe.save(path)
        return RecipeRunner(recipe, module, backend.split_gm.forward, self.function)


def support_torch_compile(cls: T | None = None, *, dynamic_arg_dims: dict[str, Any] | None = None):
    """Class decorator for a module whose constructor takes `engine_config` (keyword)."""

    def decorate(cls: T) -> T:
        dims = (
            dynamic_arg_dims if dynamic_arg_dims is not None else _default_dynamic_dims(cls.forward)
        )
        original_init = cls.__init__

        def __init__(self, *args: Any, engine_config: EngineConfig, **kwargs: Any) -> None:
            original_init(self, *args, engine_config=engine_config, **kwargs)
            compiled = engine_config.compilation_config.mode != "none"
            self._compiled_forward = (
                CompiledForward(self, engine_config, dims) if compiled else None
            )

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            compiled = self.__dict__.get("_compiled_forward")
            if compiled is None or torch.compiler.is_compiling():
                return nn.Module.__call__(self, *args, **kwargs)
            return compiled(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.__call__ = __call__
        cls._support_torch_compile = True
        return cls

    return decorate(cls) if cls is not None else decorate
