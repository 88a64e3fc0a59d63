"""Last: drop what the rewrites left unused. (The fused ops are functional, so there are
no functionalized in-place ops to turn back into in-place calls.)"""

from __future__ import annotations

from torch import fx

from passes.base import GraphPass


class CleanupPass(GraphPass):
    name = "cleanup"

    def __call__(self, graph: fx.Graph) -> int:
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        return before - len(graph.nodes)
