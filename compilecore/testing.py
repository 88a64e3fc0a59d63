"""Property-based testing helpers for model authors (`runtime.testing.compiled_eager_pair`
builds the two models; see its docstring and docs/passes.md for a test that runs as written).

    from hypothesis import given
    from compilecore import testing

    @testing.settings()
    @given(config=testing.llama_configs(), n=testing.token_counts())
    def test_my_model(config, n):
        testing.assert_compiled_matches_eager(compiled, eager, *inputs(config, n))

`llama_configs()` draws valid small HF Llama configs; `batches()` draws mixtures of prefill
chunks and decodes; `assert_compiled_matches_eager` runs both modules and fails on a
numeric difference or on any recompilation; `assert_no_recompile()` guards a block.

For pass authors: `check_pass(my_pass, fn, *inputs)` compiles `fn` with Inductor and the
pass (verified), compares the result with eager and returns a `PassTestBackend` holding
the post-grad graph before and after, the match count and op histograms (`count_ops`).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import hypothesis
import torch
from hypothesis import strategies as st
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from compilecore.counters import compilation_counter
from passes.base import GraphPass, as_pass
from passes.cleanup import CleanupPass
from passes.config import PassConfig
from passes.manager import PostGradPassManager, op_histogram
from passes.noop_elimination import NoOpEliminationPass


def settings(max_examples: int = 10, **kwargs: Any) -> hypothesis.settings:
    """Hypothesis settings that fit compiled models under pytest: no deadline (a compile
    takes seconds), no health check failing on slow draws or session fixtures, and a
    fixed seed so that a failure in CI reproduces on a laptop."""
    checks = [hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.function_scoped_fixture,
              hypothesis.HealthCheck.data_too_large]  # fmt: skip
    defaults = dict(max_examples=max_examples, deadline=None, suppress_health_check=checks,
                    derandomize=True, print_blob=True)  # fmt: skip
    return hypothesis.settings(**{**defaults, **kwargs})


@st.composite
def llama_configs(draw, max_layers: int = 3, vocab_size: int = 320, max_positions: int = 512):
    """Small valid `transformers.LlamaConfig`s: head counts that divide, KV heads that
    divide the heads (MHA, GQA, MQA), head dims that differ from hidden/heads, tied or
    untied embeddings, default or llama3 rope scaling."""
    from transformers import LlamaConfig

    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    scaling = draw(st.sampled_from([None, "llama3"]))
    rope = None
    if scaling == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max_positions // 4,
        }
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=heads * draw(st.sampled_from([8, 16])),
        head_dim=draw(st.sampled_from([8, 16, 32])),
        intermediate_size=draw(st.sampled_from([32, 64, 96])),
        num_hidden_layers=draw(st.integers(1, max_layers)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=draw(st.booleans()),
        rope_scaling=rope,
    )


def token_counts(max_tokens: int = 256) -> st.SearchStrategy[int]:
    """Batch token counts, with the sizes that break naive dynamic shapes drawn often."""
    return st.one_of(st.sampled_from([1, 2, 8, 16, 17]), st.integers(1, max_tokens))


@dataclass
class BatchSpec:
    """A mixed batch: sequences with `context` cached tokens and `query` new tokens.
    Decodes (query 1) come first, as the scheduler orders them."""

    seqs: list[tuple[int, int]]
    token_ids: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.seqs)


@st.composite
def batches(
    draw, vocab_size: int = 320, max_seqs: int = 4, max_context: int = 48, max_query: int = 24
):
    """Decodes first, then prefill chunks; a chunk may be a single token (a one-token
    prompt, or the last token of a prompt whose rest is cached), which is not a decode."""
    n_decode = draw(st.integers(0, max_seqs))
    n_prefill = draw(st.integers(0 if n_decode else 1, max_seqs))
    seqs = [(draw(st.integers(1, max_context)), 1) for _ in range(n_decode)]
    seqs += [
        (draw(st.integers(0, max_context)), draw(st.integers(1, max_query)))
        for _ in range(n_prefill)
    ]
    ids = [
        draw(st.lists(st.integers(0, vocab_size - 1), min_size=c + q, max_size=c + q))
        for c, q in seqs
    ]
    return BatchSpec(seqs, ids)


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@contextmanager
def assert_no_recompile() -> Iterator[None]:
    """Fail if anything in the block traces or compiles a graph again: our backend's
    counters, and Dynamo's own graph count for callables compiled with plain
    torch.compile."""
    before = _dynamo_graphs()
    with compilation_counter.expect(num_graphs_seen=0, num_recompiles=0, num_inductor_compiles=0):
        yield
    traced = _dynamo_graphs() - before
    if traced:
        raise AssertionError(f"Dynamo traced {traced} new graph(s): the compiled code recompiled")


# Compiled callables that had their one allowed first compile (the warm-up call).
_WARMED_UP: weakref.WeakSet = weakref.WeakSet()


def _flatten(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flatten(v)]
    if hasattr(out, "tensors"):
        return _flatten(out.tensors)
    return [t for v in out for t in _flatten(v)]


def _warmed_up(compiled: Callable) -> bool:
    try:
        if compiled in _WARMED_UP:
            return True
        _WARMED_UP.add(compiled)
    except TypeError:  # not weak-referenceable (a bound method): warm up every time
        pass
    return False


def assert_compiled_matches_eager(
    compiled: Callable,
    eager: Callable,
    *args: Any,
    context: Callable[[], Any] | None = None,
    rtol: float | None = None,
    warm_up: bool = True,
) -> None:
    """Run both on `args` (inside `context()` if given) and compare every output tensor,
    relative to its largest value. The first call ever made here with a given `compiled`
    callable may compile (a warm-up call); after that no call may, so a model that
    specialises on a shape fails on the next shape drawn. Default tolerance: 1e-5 for
    fp32, 2e-2 otherwise."""
    ctx = context or nullcontext
    with torch.inference_mode():
        if warm_up and not _warmed_up(compiled):
            with ctx():
                compiled(*args)
        with assert_no_recompile(), ctx():
            got = _flatten(compiled(*args))
        with ctx():
            want = _flatten(eager(*args))
    assert len(got) == len(want), f"{len(got)} outputs compiled, {len(want)} eager"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"output {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        tol = rtol if rtol is not None else (1e-5 if w.dtype == torch.float32 else 2e-2)
        scale = max(w.float().abs().max().item(), 1e-6)
        diff = (g.float() - w.float()).abs().max().item()
        assert diff <= tol * scale, f"output {i}: compiled differs from eager by {diff:.3g}"


class _Recorder(CustomGraphPass):
    def __init__(self, backend: PassTestBackend):
        self.backend = backend

    def __call__(self, graph: fx.Graph) -> None:
        self.backend.graph_before = copy.deepcopy(graph)
        self.backend.manager(graph)
        self.backend.graph_after = copy.deepcopy(graph)

    def uuid(self) -> str:
        return self.backend.manager.uuid()


class PassTestBackend:
    """A torch.compile backend (vLLM's tests/compile/backend.py idea): Inductor with the
    given passes between no-op elimination and clean-up, keeping the post-grad graph
    before and after them. `verify=True` runs the pass verifier on every pass."""

    def __init__(self, *passes: Any, verify: bool = False):
        self.manager = PostGradPassManager(
            PassConfig(verify=verify),
            passes=[NoOpEliminationPass(), *(as_pass(p) for p in passes), CleanupPass()],
        )
        self.graph_before: fx.Graph | None = None
        self.graph_after: fx.Graph | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        patches = {
            "post_grad_custom_pre_pass": _Recorder(self),
            "force_disable_caches": True,  # a cache hit would skip the passes
        }
        return compile_fx(gm, example_inputs, config_patches=patches)

    def matches(self, name: str) -> int:
        return sum(counts.get(name, 0) for counts in self.manager.match_counts.values())

    def ops_before(self) -> dict[str, int]:
        return op_histogram(self.graph_before) if self.graph_before is not None else {}

    def ops_after(self) -> dict[str, int]:
        return op_histogram(self.graph_after) if self.graph_after is not None else {}


def count_ops(graph: fx.Graph, target: Any) -> int:
    """Calls of `target`: an op packet counts every one of its overloads."""

    def same(t: Any) -> bool:
        return t is target or getattr(t, "_overloadpacket", None) is target

    return sum(1 for n in graph.nodes if n.op == "call_function" and same(n.target))


def check_pass(
    graph_pass: GraphPass | Any,
    fn: Callable,
    *inputs: torch.Tensor,
    dynamic: bool = True,
    rtol: float | None = None,
) -> PassTestBackend:
    """Compile `fn` with `graph_pass` (verified on every piece it matches, dim 0 of each
    input unbacked like the engine's token dimension), check its output against eager
    `fn`, and return the backend for op counts and `matches(name)`. Resets Dynamo first,
    so the pass always sees a fresh trace."""
    torch._dynamo.reset()
    backend = PassTestBackend(graph_pass, verify=True)
    for t in inputs if dynamic else ():
        torch._dynamo.decorators.mark_unbacked(t, 0)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        assert_compiled_matches_eager(compiled, fn, *inputs, rtol=rtol)
    return backend
