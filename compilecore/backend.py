"""The Dynamo backend: split at attention, compile each piece with Inductor once (per
distinct piece, and per size in `compile_sizes`), cache the results on disk, and return
the split module whose generated Python calls the compiled pieces in order."""

from __future__ import annotations

import functools
import logging
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import graph_returns_tuple
from torch._subclasses.fake_tensor import FakeTensorMode

from compilecore.compile_cache import (
    CompileCache,
    cache_factors,
    cache_key,
    load_pass_report,
    save_pass_report,
    traced_files,
)
from compilecore.config import EngineConfig
from compilecore.counters import compilation_counter
from compilecore.cuda_graph import CUDAGraphWrapper
from compilecore.dump import dump_root, write_graphs, write_inductor_code
from compilecore.recipe import ForwardRecipe, NoRecipe, exec_forward, generated_code, graph_inputs
from compilecore.split import Piece, graph_signature, split_graph
from compilecore.wrapper_codegen import recorded_kernel_calls
from passes.manager import PostGradPassManager

logger = logging.getLogger("compilecore")
# A quantized embedding's lookup dequantizes fp16 scales into bf16 rows in one loop, which
# Inductor compiles correctly and warns about on every compile (cpp.py).
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")


@dataclass
class CompileStats:
    trace_s: float = 0.0
    inductor_s: float = 0.0
    load_s: float = 0.0
    pieces: int = 0
    factors: dict[str, Any] = field(default_factory=dict)
    # pass name -> sites rewritten over all pieces (a shared compile counts per piece)
    pass_matches: dict[str, int] = field(default_factory=dict)  # symbolic-size code
    pass_matches_by_variant: dict[str, dict[str, int]] = field(default_factory=dict)
    piece_matches: dict[str, dict[str, int]] = field(default_factory=dict)  # per compile


def _token_dim(args: Sequence[Any]) -> tuple[int, int | None] | None:
    """Where the runtime token count is found: (arg index, None) for a SymInt argument,
    (arg index, dim) for a tensor with a symbolic dim."""
    for i, a in enumerate(args):
        if isinstance(a, torch.SymInt):
            return i, None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            for d, s in enumerate(a.shape):
                if isinstance(s, torch.SymInt):
                    return i, d
    return None


def _concretize(args: Sequence[Any], size: int, mode: FakeTensorMode) -> list[Any]:
    """The piece's example inputs with every symbolic size set to `size`."""

    def value(s):
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            return int(expr.subs({sym: size for sym in expr.free_symbols}))
        return int(s)

    out = []
    for a in args:
        if isinstance(a, torch.SymInt):
            out.append(size)
        elif isinstance(a, torch.Tensor):
            shape = [value(s) for s in a.shape]
            stride = [value(s) for s in a.stride()]
            with mode:
                out.append(torch.empty_strided(shape, stride, dtype=a.dtype, device=a.device))
        else:
            out.append(a)
    return out


# Code for a static token count (batch-1 decode on CPU): every pointwise value that feeds a
# reduction is computed once into its own (tiny) buffer instead of being recomputed inside the
# reduction's loop for every output row, so the GEMV loops only stream weights
# (docs/kernel-choices.md, Static-size code). Not where Inductor dequantizes weights itself (no
# native quantized product): a dequantized weight is such a value, and it would be written out
# whole in fp32 every step (the default Q4_1 model at batch 1 on an AVX2 CPU: 6.6 tok/s with the
# option, 8.5 without).
STATIC_SIZE_OPTIONS: dict[str, Any] = {"realize_opcount_threshold": 0}
_DEQUANTIZE_OPS = (["compilecore", "dequantize_q4"], ["compilecore", "dequantize_q8"])


class PiecewiseBackend:
    """One compiled piece: the general (symbolic-size) artifact plus one per compile size."""

    def __init__(self, general: Callable, by_size: dict[int, Callable], token_dim):
        self.general, self.by_size, self.token_dim = general, by_size, token_dim

    def __call__(self, *args: Any) -> Any:
        if self.by_size and self.token_dim is not None:
            i, d = self.token_dim
            n = args[i] if d is None else args[i].shape[d]
            fn = self.by_size.get(n)
            if fn is not None:
                return fn(*args)
        return self.general(*args)


class FirstOutputs:
    """Calls the split module and keeps its first outputs, against which the recipe
    matches what forward returned."""

    def __init__(self, fn: Callable):
        self.fn, self.outputs = fn, None

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.outputs is None:
            self.outputs = list(out)
        return out


class CompilecoreBackend:
    def __init__(self, engine_config: EngineConfig, tag: str, pass_manager: PostGradPassManager):
        self.config = engine_config
        self.tag = tag
        self.pass_manager = pass_manager
        self.stats = CompileStats()
        self.trace_start: float | None = None
        self.split_gm: fx.GraphModule | None = None
        self.pieces: list[Piece] = []
        self.canonical: dict[str, str] = {}  # piece name -> name of the piece compiled for it
        self.runnables: dict[str, PiecewiseBackend] = {}  # by that canonical name
        self.cache_key = ""
        self.traced_files: list[str] = []
        self.input_sources: list[str] | NoRecipe = NoRecipe("not traced")
        self.first: FirstOutputs | None = None

    @property
    def must_run_passes(self) -> bool:
        """Dumps and the verifier need the passes to run: no cached artifact will do."""
        cc = self.config.compilation_config
        return bool(cc.debug_dump_path) or cc.passes.verify

    def inductor_options(
        self, static: bool = False, gm: fx.GraphModule | None = None
    ) -> dict[str, Any]:
        realize = static and not (gm is not None and self._inductor_dequantizes(gm))
        patches = dict(STATIC_SIZE_OPTIONS if realize else {})
        if self.config.compilation_config.batch_invariant:
            # A reduction split over programs by the row count would sum a row in another
            # order at another batch.
            patches["split_reductions"] = False
        patches.update(self.config.compilation_config.inductor_options)
        patches["post_grad_custom_pre_pass"] = self.pass_manager
        if self.must_run_passes:
            patches["force_disable_caches"] = True
        return {"config_patches": patches}

    def _inductor_dequantizes(self, gm: fx.GraphModule) -> bool:
        """Whether the graph dequantizes a weight that no native product takes over (the
        `quantized_linear` pass off here), leaving it to Inductor's own loops."""
        if self.pass_manager.switches.get("quantized_linear"):
            return False
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        return any(t.split(".")[:2] in _DEQUANTIZE_OPS for t in targets)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        compilation_counter.num_graphs_seen += 1
        if self.split_gm is not None:
            compilation_counter.num_recompiles += 1
        start = time.perf_counter()
        if self.trace_start is not None:
            self.stats.trace_s = start - self.trace_start
        cc = self.config.compilation_config
        self.traced_files = traced_files(gm)
        self.stats.factors = cache_factors(
            self.config, gm, self.pass_manager.uuid(), self.traced_files, example_inputs
        )
        self.cache_key = cache_key(self.stats.factors)
        try:
            self.input_sources = graph_inputs(gm)
        except NoRecipe as e:
            self.input_sources = e
        cache = CompileCache(self.config, self.cache_key, self.tag)
        cache.enabled = cache.enabled and not self.must_run_passes
        split_gm, pieces = split_graph(gm, cc.splitting_ops)
        self.split_gm, self.pieces = split_gm, pieces
        compilation_counter.num_piecewise_graphs_seen += len(pieces)
        to_compile = {p.name: p for p in pieces if not p.is_splitting_op}
        compilation_counter.num_piecewise_capturable_graphs_seen += len(to_compile)
        self.stats.pieces = len(pieces)

        fake_mode = detect_fake_mode(example_inputs)
        compiled: dict[str, Callable] = {}  # graph signature -> PiecewiseBackend
        self.canonical, self.runnables = {}, {}
        self.artifacts: dict[str, Any] = {}  # piece_N and piece_N_size_S -> its artifact

        backend = self

        class Compiler(fx.Interpreter):
            def call_module(self, target, args, kwargs):
                out = super().call_module(target, args, kwargs)
                piece = to_compile.get(target)
                if piece is not None:
                    runnable = backend._compile_piece(piece, list(args), cache, compiled)
                    split_gm.__dict__[target] = runnable
                return out

        if self._all_cached(cache, list(to_compile.values())):
            # A warm start compiles nothing, so the pieces' example inputs recorded at
            # tracing are enough: no fake-tensor run through the whole graph.
            for piece in to_compile.values():
                args = [
                    n.meta.get("example_value", n.meta.get("val"))
                    for n in piece.graph.graph.nodes
                    if n.op == "placeholder"
                ]
                split_gm.__dict__[piece.name] = self._compile_piece(piece, args, cache, compiled)
        else:
            fake_args = [
                fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                for t in example_inputs
            ]
            with fake_mode, enable_python_dispatcher():
                Compiler(split_gm).run(*fake_args)
        self._total_matches(cache)
        root = dump_root(self.config)
        if root is not None:
            write_graphs(root / self.tag, gm, split_gm, pieces)
            for name, artifact in self.artifacts.items():
                write_inductor_code(root / self.tag, name, artifact)
        total = time.perf_counter() - start
        logger.info(
            "compiled %s: %d pieces (%d compiled, %d distinct) in %.1f s "
            "(tracing %.1f s, inductor %.1f s, loading %.1f s), cache %s",
            self.tag,
            len(pieces),
            len(to_compile),
            len(compiled),
            total + self.stats.trace_s,
            self.stats.trace_s,
            self.stats.inductor_s,
            self.stats.load_s,
            cache.dir,
        )
        self.first = FirstOutputs(split_gm)
        return self.first

    def _all_cached(self, cache: CompileCache, pieces: list[Piece]) -> bool:
        """Whether every artifact this graph needs is in the cache (same naming and
        de-duplication as _compile_piece)."""
        if not cache.enabled:
            return False
        sizes = sorted(set(self.config.compilation_config.compile_sizes))
        seen: set[str] = set()
        for piece in pieces:
            signature = graph_signature(piece.graph)
            if signature in seen:
                continue
            seen.add(signature)
            names = [f"piece_{piece.index}"] + [f"piece_{piece.index}_size_{s}" for s in sizes]
            if not all(cache.path(name).is_file() for name in names):
                return False
        return True

    def _total_matches(self, cache: CompileCache) -> None:
        counts = self.pass_manager.match_counts
        if counts:
            cache.save_json("pass_matches", counts)
        else:  # everything came from the cache: report what the compile that made it saw
            counts = cache.load_json("pass_matches") or {}
        # Per variant of the code (symbolic size, each compile size), over every piece that
        # runs it: a middle piece compiled once for 29 layers counts 29 times.
        by_variant: dict[str, dict[str, int]] = {}
        sizes = sorted(set(self.config.compilation_config.compile_sizes))
        variants = {"general": ""} | {f"size_{s}": f"_size_{s}" for s in sizes}
        for canonical in self.canonical.values():
            for variant, suffix in variants.items():
                totals = by_variant.setdefault(variant, {})
                for name, n in counts.get(canonical + suffix, {}).items():
                    totals[name] = totals.get(name, 0) + n
        self.stats.pass_matches = by_variant["general"]
        self.stats.pass_matches_by_variant = by_variant
        self.stats.piece_matches = counts

    def _compile_piece(
        self, piece: Piece, args: list[Any], cache: CompileCache, compiled: dict
    ) -> Callable:
        signature = graph_signature(piece.graph)
        if signature in compiled:  # an identical decoder layer: reuse its code
            runnable, canonical = compiled[signature]
            self.canonical[piece.name] = canonical
            return self._wrap(runnable, piece.index)
        self.canonical[piece.name] = f"piece_{piece.index}"
        compilation_counter.num_backend_compilations += 1
        token_dim = _token_dim(args)
        general = self._compile_or_load(piece, args, f"piece_{piece.index}", cache, dynamic=True)
        self.artifacts[f"piece_{piece.index}"] = general
        by_size = {}
        for size in sorted(set(self.config.compilation_config.compile_sizes)):
            concrete = _concretize(args, size, FakeTensorMode(allow_non_fake_inputs=True))
            name = f"piece_{piece.index}_size_{size}"
            by_size[size] = self._compile_or_load(piece, concrete, name, cache, dynamic=False)
            self.artifacts[name] = by_size[size]
        runnable = PiecewiseBackend(general, by_size, token_dim)
        compiled[signature] = (runnable, f"piece_{piece.index}")
        self.runnables[f"piece_{piece.index}"] = runnable
        return self._wrap(runnable, piece.index)

    def _wrap(self, runnable: PiecewiseBackend, index: int) -> Callable:
        wrapper = CUDAGraphWrapper(runnable, self.config, index, runnable.token_dim)
        if wrapper.enabled:
            return wrapper
        # No CUDA graphs and no per-size code: call the artifact itself (one less frame
        # per piece per step).
        return runnable if runnable.by_size else runnable.general

    def _compile_or_load(
        self, piece: Piece, args: list[Any], name: str, cache: CompileCache, dynamic: bool
    ):
        artifact = self._load(name, graph_returns_tuple(piece.graph), cache)
        if artifact is not None:
            compilation_counter.num_cache_hits += 1
            return artifact
        t0 = time.perf_counter()
        if cache.enabled:
            compilation_counter.num_cache_misses += 1
        compilation_counter.num_inductor_compiles += 1
        self.pass_manager.current_piece, self.pass_manager.example_inputs = name, args
        # Without caches Inductor cannot make a savable artifact and says so; we do not save.
        quiet = logging.getLogger("torch._inductor.standalone_compile")
        level = quiet.level
        if not cache.enabled:
            quiet.setLevel(logging.ERROR)
        try:
            with recorded_kernel_calls():
                artifact = torch._inductor.standalone_compile(
                    piece.graph,
                    args,
                    dynamic_shapes="from_tracing_context" if dynamic else "from_example_inputs",
                    options=self.inductor_options(static=not dynamic, gm=piece.graph),
                )
        finally:
            quiet.setLevel(level)
        self._pass_report(name, self._pass_report_key(piece, args, dynamic))
        cache.save(name, artifact)
        self.stats.inductor_s += time.perf_counter() - t0
        return artifact

    def _pass_report_key(self, piece: Piece, args: list[Any], dynamic: bool) -> str:
        inputs = [
            f"{a.dtype}{[str(d) for d in a.shape]}" if isinstance(a, torch.Tensor) else repr(a)
            for a in args
        ]
        return cache_key({
            "graph": graph_signature(piece.graph), "inputs": inputs, "dynamic": dynamic,
            "passes": self.pass_manager.uuid(), "torch": torch.__version__,
        })  # fmt: skip

    def _pass_report(self, name: str, key: str) -> None:
        """Match counts and op histograms of this compile. When Inductor's FX graph cache
        answered (code compiled before, e.g. under another compilecore cache dir), the
        passes did not run: the report of the compile that ran them stands in."""
        manager = self.pass_manager
        if name in manager.match_counts:
            histogram = manager.histograms.get(name)
            save_pass_report(key, {"matches": manager.match_counts[name], "histogram": histogram})
        elif (report := load_pass_report(key)) is not None:
            manager.match_counts[name] = report["matches"]
            if report.get("histogram"):
                manager.histograms[name] = report["histogram"]
        else:
            logger.info("%s: Inductor's cache answered and no pass report was found", name)

    def _load(self, name: str, returns_tuple: bool, cache: CompileCache) -> Callable | None:
        t0 = time.perf_counter()
        artifact = cache.load(name)
        self.stats.load_s += time.perf_counter() - t0
        if artifact is None or returns_tuple:
            return artifact
        # A loaded artifact always returns a list; the split module expects the value.
        return lambda *a, _art=artifact: _art(*a)[0]

    def recipe_parts(self) -> tuple[str, list[dict[str, Any]]]:
        """The split module's code and, per piece, its code (attention, run as is) or the
        artifact that serves it."""
        pieces = []
        for piece in self.pieces:
            entry: dict[str, Any] = {"name": piece.name, "index": piece.index}
            canonical = self.canonical.get(piece.name)
            if canonical is None:
                entry["code"] = generated_code(piece.graph)
            else:
                entry["artifact"] = canonical
                entry["returns_tuple"] = graph_returns_tuple(piece.graph)
                entry["token_dim"] = self.runnables[canonical].token_dim
            pieces.append(entry)
        return generated_code(self.split_gm), pieces

    def load_recipe(self, recipe: ForwardRecipe) -> Callable | None:
        """The split module rebuilt from a recipe and cached artifacts, with no tracing;
        None if an artifact is missing or unreadable (then Dynamo traces as usual)."""
        cache = CompileCache(self.config, recipe.cache_key, self.tag)
        if not cache.enabled:
            return None
        start = time.perf_counter()
        sizes = sorted(set(self.config.compilation_config.compile_sizes))
        stitched = types.SimpleNamespace()
        runnables: dict[str, PiecewiseBackend] = {}
        for p in recipe.pieces:
            if "code" in p:
                fn = exec_forward(p["code"], f"<compilecore {self.tag} {p['name']}>")
                setattr(stitched, p["name"], functools.partial(fn, None))
                continue
            name = p["artifact"]
            if name not in runnables:
                names = [name] + [f"{name}_size_{s}" for s in sizes]
                loaded = [self._load(n, p["returns_tuple"], cache) for n in names]
                if any(a is None for a in loaded):
                    return None
                token_dim = tuple(p["token_dim"]) if p["token_dim"] is not None else None
                runnables[name] = PiecewiseBackend(
                    loaded[0], dict(zip(sizes, loaded[1:])), token_dim
                )
            self.canonical[p["name"]] = name
            setattr(stitched, p["name"], self._wrap(runnables[name], p["index"]))
        self.runnables, self.cache_key = runnables, recipe.cache_key
        compilation_counter.num_cache_hits += len(runnables) * (1 + len(sizes))
        compilation_counter.num_piecewise_graphs_seen += len(recipe.pieces)
        compilation_counter.num_piecewise_capturable_graphs_seen += len(self.canonical)
        compilation_counter.num_backend_compilations += len(runnables)
        self.stats.pieces = len(recipe.pieces)
        self._total_matches(cache)
        logger.info(
            "loaded %s from its recipe: %d pieces (%d distinct) in %.1f s, no tracing, cache %s",
            self.tag,
            len(recipe.pieces),
            len(runnables),
            time.perf_counter() - start,
            cache.dir,
        )
        return functools.partial(exec_forward(recipe.split_code, f"<compilecore {self.tag}>"),
                                 stitched)  # fmt: skip
