"""Remove ops that do nothing, so the fusion patterns see a canonical graph.

y = reshape(x, shape_of_x)          ->  y = x
y = slice(x, dim, 0, >= size, 1)    ->  y = x
y = convert_element_type(x, x.dtype) -> y = x
"""

from __future__ import annotations

import torch
from torch import fx

from passes.base import GraphPass

aten, prims = torch.ops.aten, torch.ops.prims


def _shape(node) -> list[str] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return [str(s) for s in value.shape] if isinstance(value, torch.Tensor) else None


def _is_noop(node: fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src = node.args[0]
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return _shape(src) is not None and _shape(src) == _shape(node)
    if node.target is aten.slice.Tensor:
        return (
            _shape(src) is not None and _shape(src) == _shape(node) and node.args[4:] in ((), (1,))
        )
    if node.target is prims.convert_element_type.default:
        value = src.meta.get("val")
        return isinstance(value, torch.Tensor) and value.dtype == node.args[1]
    return False


class NoOpEliminationPass(GraphPass):
    name = "noop_elimination"

    def __call__(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if _is_noop(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                count += 1
        return count
