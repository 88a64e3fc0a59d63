"""What every pass is: a callable on a post-grad FX graph that returns how many sites it
rewrote, with a uuid that changes when its source or configuration changes.

This is also the public API for passes written outside this package (docs/passes.md's
"Write a pass"): subclass `GraphPass`, or build a `PatternPass` from a search function,
a replace function and example inputs, and hand it to
`compilation_config={"custom_passes": [...]}`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import sys
import uuid as uuid_lib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement
from torch._subclasses.fake_tensor import FakeTensorMode

if TYPE_CHECKING:
    from passes.config import AttentionShape

logger = logging.getLogger("compilecore.passes")


def _source_digest(objects: Sequence[Any], what: str) -> str | None:
    """sha256 over the source of each module or function; None when one has no source
    (defined in a REPL or a notebook cell that is gone), with a warning."""
    h = hashlib.sha256()
    for obj in objects:
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            logger.warning(
                "%s: no source for %r, so its uuid is random and its compiled code is never "
                "reused across processes; define it in a file to let the cache work",
                what,
                obj,
            )
            return None
    return h.hexdigest()


class GraphPass:
    """A pass over one piece's post-grad graph (aten ops, functional, after Inductor's
    decompositions). `__call__` rewrites the graph in place and returns how many sites it
    rewrote (0 when nothing matched); `uuid()` must change whenever what the pass does
    changes, because it is part of the compile cache key. The default hashes the source of
    the modules the pass class is defined in (and `depends_on`) plus `config()`."""

    name = "graph_pass"
    # Other modules whose source shapes what the pass matches or emits (pattern math).
    depends_on: tuple[str, ...] = ()

    def __call__(self, graph: fx.Graph) -> int:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {}

    def source_objects(self) -> list[Any]:
        """The pass's modules, `depends_on`, and the `passes.ops` modules those reach through
        their imports: code the replacement traces may live one import away (the K-quants'
        layouts, imported by the ops' module), and a cache key that missed it served stale
        code (tests/test_passes.py)."""
        names = [cls.__module__ for cls in type(self).__mro__] + list(self.depends_on)
        names = [n for n in dict.fromkeys(names) if n.split(".")[0] not in ("builtins", "torch")]
        todo = [sys.modules[n] for n in names if n in sys.modules]
        found = {module.__name__: module for module in todo}
        while todo:
            for value in vars(todo.pop()).values():
                name = getattr(value, "__name__" if inspect.ismodule(value) else "__module__", "")
                name = name if isinstance(name, str) else ""
                module = sys.modules.get(name)
                if name.startswith("passes.ops.") and name not in found and module is not None:
                    found[name] = module
                    todo.append(module)
        return list(found.values())

    def uuid(self) -> str:
        cached = getattr(self, "_uuid", None)
        if cached is None:
            digest = _source_digest(self.source_objects(), f"pass {self.name}")
            config = json.dumps(self.config(), sort_keys=True, default=str)
            cached = self._uuid = hashlib.sha256(
                f"{digest or uuid_lib.uuid4().hex}|{config}".encode()
            ).hexdigest()
        return cached


class PatternPass(GraphPass):
    """A pass made of Inductor `register_replacement` patterns, registered under a fake
    mode (tracing a pattern runs no real kernels or collectives). Two ways to make one:

    - `PatternPass(search, replace, example_inputs, name=...)`, and `.add(...)` for more
      patterns in the same pass. `search` and `replace` take the same tensors and return
      the same number of outputs; the example inputs only fix ranks and dtypes (a match is
      retraced with its real shapes). `scalar_workaround` and `extra_check` go to
      `register_replacement`.
    - a subclass that overrides `register()` and calls `register_replacement` itself.
    """

    def __init__(
        self,
        search: Callable | None = None,
        replace: Callable | None = None,
        example_inputs: Sequence[Any] | None = None,
        *,
        name: str | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
        **options: Any,
    ) -> None:
        # Only these dtypes (None: every one): for passes whose op has a kernel for some.
        self.dtypes = tuple(dtypes) if dtypes is not None else None
        if name is not None:
            self.name = name
        elif search is not None and type(self).name == PatternPass.name:
            self.name = search.__name__
        self.entries: list[tuple[Callable, Callable, list[Any], dict[str, Any]]] = []
        self._register_all()
        if search is not None or replace is not None or example_inputs is not None:
            self.add(search, replace, example_inputs, **options)

    def add(
        self,
        search: Callable | None,
        replace: Callable | None,
        example_inputs: Sequence[Any] | None,
        *,
        scalar_workaround: dict[str, float] | None = None,
        extra_check: Callable[[Any], bool] | None = None,
    ) -> PatternPass:
        """Register one more search -> replace pattern in this pass."""
        if search is None or replace is None or example_inputs is None:
            raise TypeError("a pattern needs search, replace and example_inputs")
        options = {"scalar_workaround": scalar_workaround or {}}
        if extra_check is not None:
            options["extra_check"] = extra_check
        entry = (search, replace, list(example_inputs), options)
        self.entries.append(entry)
        self._register_entry(entry)
        self._uuid = None
        return self

    def _register_entry(self, entry: tuple) -> None:
        search, replace, example_inputs, options = entry
        with FakeTensorMode():
            fake = [  # only shapes and dtypes matter; real example tensors are never read
                torch.empty(v.shape, dtype=v.dtype, device=v.device)
                if isinstance(v, torch.Tensor) else v
                for v in example_inputs
            ]  # fmt: skip
            register_replacement(search, replace, fake, trace_pattern, self.patterns, **options)

    def _register_all(self) -> None:
        self.patterns = PatternMatcherPass(pass_name=self.name)
        with FakeTensorMode():
            self.register()
        for entry in self.entries:
            self._register_entry(entry)

    # Traced patterns do not pickle; a spawned tensor-parallel worker registers them again.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "patterns"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._register_all()

    def register(self) -> None:
        """Subclasses register their patterns here; patterns given to `add` need not."""

    def source_objects(self) -> list[Any]:
        functions = [f for entry in self.entries for f in (entry[0], entry[1])]
        functions += [e[3]["extra_check"] for e in self.entries if "extra_check" in e[3]]
        return super().source_objects() + [inspect.getmodule(f) or f for f in functions]

    def pattern_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes to register patterns for: `dtypes`, else `PATTERN_DTYPES`."""
        return PATTERN_DTYPES if self.dtypes is None else self.dtypes

    def config(self) -> dict[str, Any]:
        patterns = [
            [s.__qualname__, r.__qualname__, [_describe(v) for v in x]]
            for s, r, x, _ in self.entries
        ]
        dtypes = None if self.dtypes is None else [str(d) for d in self.dtypes]
        return {"patterns": patterns} | ({"dtypes": dtypes} if dtypes else {})

    def __call__(self, graph: fx.Graph) -> int:
        return self.patterns.apply(graph)


class AttentionShapePatternPass(PatternPass):
    """A pattern pass registered once per attention shape of the model (head counts and
    head size are constants of its patterns)."""

    def __init__(self, shapes: list[AttentionShape], dtypes: Sequence[torch.dtype] | None = None):
        self.shapes = sorted(set(shapes), key=lambda s: (s.num_heads, s.num_kv_heads, s.head_dim))
        super().__init__(dtypes=dtypes)

    def config(self) -> dict:
        shapes = [(s.num_heads, s.num_kv_heads, s.head_dim) for s in self.shapes]
        return super().config() | {"shapes": shapes}


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}:{value.dim()}"
    return repr(value)


class FunctionPass(GraphPass):
    """A plain function `graph -> sites rewritten` as a pass, named after the function."""

    def __init__(self, fn: Callable[[fx.Graph], int], name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__

    def source_objects(self) -> list[Any]:
        return [inspect.getmodule(self.fn) or self.fn]

    def __call__(self, graph: fx.Graph) -> int:
        return self.fn(graph)


def as_pass(spec: Any) -> GraphPass:
    """A user's pass spec as a GraphPass: a GraphPass instance, a GraphPass subclass or a
    function of no arguments that returns one (called), a function `graph -> int`, or any
    of these as a dotted path `package.module:attribute` (what `--custom-pass` takes)."""
    if isinstance(spec, str):
        spec = _import(spec)
    if inspect.isfunction(spec) and _takes_no_arguments(spec):
        spec = spec()
    if isinstance(spec, type) and issubclass(spec, GraphPass):
        spec = spec()
    if isinstance(spec, GraphPass):
        return spec
    if inspect.isfunction(spec) and not _takes_no_arguments(spec):
        return FunctionPass(spec)
    raise TypeError(
        f"custom pass {spec!r} is not a pass: give a passes.GraphPass (or subclass), a "
        "passes.PatternPass, a function graph -> int, or a 'module:attribute' path to one"
    )


def _import(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"custom pass {path!r}: write it as 'package.module:attribute'")
    if os.getcwd() not in sys.path:  # as uvicorn does: modules next to where you run
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"custom pass {path!r} cannot be loaded: {e}") from e


def _takes_no_arguments(fn: Callable) -> bool:
    params = inspect.signature(fn).parameters.values()
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params)  # fmt: skip


PATTERN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_graph_input(node: Any) -> bool:
    """Whether a matched value is one of the graph's inputs (a weight, not a value computed
    in the graph such as a dequantized weight, which is new each run)."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def trace_pattern(*args: Any, **kwargs: Any) -> fx.GraphModule:
    """`fwd_only`, then Inductor's own `view_to_reshape`: post-grad graphs (what the
    pattern is matched against) have every view turned into a reshape by then."""
    try:
        gm = fwd_only(*args, **kwargs)
    except ValueError as e:
        # The matcher retraces a candidate with its real shapes and treats RuntimeError as
        # "no match"; a shape this pattern cannot take (split sizes) raises ValueError.
        raise RuntimeError(f"pattern does not apply to these shapes: {e}") from e
    view_to_reshape(gm)
    return gm


def dtype_check(argument: str, dtypes: Sequence[torch.dtype] | None) -> Callable[[Any], bool]:
    """An `extra_check` that takes a match only where `argument`'s dtype is one of
    `dtypes` (any dtype for None): for passes whose op has a kernel only for some dtypes
    (a pattern's converts do not name the dtype they convert to)."""

    def check(match: Any) -> bool:
        value = match.kwargs[argument].meta.get("val")
        return dtypes is None or (isinstance(value, torch.Tensor) and value.dtype in dtypes)

    return check
