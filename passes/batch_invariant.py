"""Every product -> `compilecore.invariant_mm`: batch-invariant mode's products.

Unfused (a linear layer in the symbolic-size code; `addmm` where it has a bias):

    y = mm(x, wt)                        # x [M, K]: M the step's token count
    y = addmm(b, x, wt)

Rewritten:

    y = compilecore.invariant_mm(x, wt)
    y = add(compilecore.invariant_mm(x, wt), b)

One site per product: 4 per Llama layer (QKV, o, gate_up, down). With this pass on, the
passes that choose a kernel by the row count (native_linear, gemv_to_reduction,
packed_linear, quantized_linear) are off (`PassConfig.resolved`) and no piece is compiled
for a static size, so a row's arithmetic is the same in every batch
(tests/test_batch_invariant.py).
"""

from __future__ import annotations

import torch
from torch import fx

from passes.base import GraphPass
from passes.ops import invariant_mm  # noqa: F401 - registers the op

aten = torch.ops.aten


class BatchInvariantPass(GraphPass):
    name = "batch_invariant"
    depends_on = ("passes.ops.invariant_mm",)

    def __call__(self, graph: fx.Graph) -> int:
        count = 0
        op = torch.ops.compilecore.invariant_mm.default
        products = (aten.mm.default, aten.addmm.default)
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in products:
                continue
            if node.target is aten.addmm.default and (node.kwargs or len(node.args) != 3):
                continue  # alpha / beta: not a linear layer's
            with graph.inserting_before(node):
                if node.target is aten.mm.default:
                    new = graph.call_function(op, node.args)
                else:
                    bias, a, b = node.args
                    product = graph.call_function(op, (a, b))
                    product.meta["val"] = node.meta.get("val")
                    new = graph.call_function(aten.add.Tensor, (product, bias))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            count += 1
        return count
