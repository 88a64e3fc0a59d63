"""A test backend in the style of vLLM's tests/compile/backend.py: compile with Inductor
and our pass manager, keep the post-grad graph before and after the passes, count ops."""

from __future__ import annotations

import copy

from torch import fx
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from passes.cleanup import CleanupPass
from passes.config import PassConfig
from passes.manager import PostGradPassManager
from passes.noop_elimination import NoOpEliminationPass


class _Recorder(CustomGraphPass):
    def __init__(self, manager: PostGradPassManager, backend: PassTestBackend):
        self.manager, self.backend = manager, backend

    def __call__(self, graph: fx.Graph) -> None:
        self.backend.graph_before = copy.deepcopy(graph)
        self.manager(graph)
        self.backend.graph_after = copy.deepcopy(graph)

    def uuid(self) -> str:
        return self.manager.uuid()


class PassTestBackend:
    def __init__(self, *passes, verify: bool = False):
        self.manager = PostGradPassManager(
            PassConfig(verify=verify), passes=[NoOpEliminationPass(), *passes, CleanupPass()]
        )
        self.graph_before: fx.Graph | None = None
        self.graph_after: fx.Graph | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs):
        patches = {
            "post_grad_custom_pre_pass": _Recorder(self.manager, self),
            "force_disable_caches": True,  # a cache hit would skip the passes
        }
        return compile_fx(gm, example_inputs, config_patches=patches)

    def matches(self, name: str) -> int:
        return sum(counts.get(name, 0) for counts in self.manager.match_counts.values())


def count_ops(graph: fx.Graph, target) -> int:
    """Calls of `target`: an op packet counts every one of its overloads."""

    def same(t) -> bool:
        return t is target or getattr(t, "_overloadpacket", None) is target

    return sum(1 for n in graph.nodes if n.op == "call_function" and same(n.target))
