"""Cutting the Dynamo graph at the splitting ops (attention).

L attention layers give 2L+1 pieces: the code before the first attention, each attention
call alone, the code between two attentions, and the code after the last. The pieces
around attention are compiled; the attention pieces run eagerly, so they can read
per-step metadata and be left out of CUDA graphs.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module


@dataclass
class Piece:
    index: int
    name: str  # attribute of the split module ("submod_3")
    graph: fx.GraphModule
    is_splitting_op: bool


def _op_names(target) -> set[str]:
    """Names a call target answers to: `ns::op` for the packet and for its overloads."""
    names = set()
    if isinstance(target, torch._ops.OpOverloadPacket):
        names.add(target._qualified_op_name)
    elif isinstance(target, torch._ops.OpOverload):
        names.add(target._schema.name)
        names.add(f"{target._schema.name}.{target._overloadname}")
    return names


def is_splitting_node(node: fx.Node, splitting_ops: list[str]) -> bool:
    if node.op != "call_function":
        return False
    return bool(_op_names(node.target) & set(splitting_ops))


def decompose_sizes(gm: fx.GraphModule) -> None:
    """Replace `x.size()` by one `sym_size` per dim, so no `torch.Size` crosses a cut
    (a piece's inputs must be tensors and ints)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not (node.op == "call_method" and node.target == "size" and len(node.args) == 1):
            continue
        value = node.args[0].meta.get("example_value")
        if value is None:
            continue
        with graph.inserting_after(node):
            dims = []
            for i, size in enumerate(value.shape):
                if isinstance(size, int):
                    dims.append(size)
                else:
                    dims.append(graph.call_function(torch.ops.aten.sym_size.int, (node.args[0], i)))
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(dims[user.args[1]])
                graph.erase_node(user)
            else:
                user.args = fx.map_arg(
                    user.args, lambda a, n=node, d=dims: list(d) if a is n else a
                )
                user.kwargs = fx.map_arg(
                    user.kwargs, lambda a, n=node, d=dims: list(d) if a is n else a
                )
        graph.erase_node(node)
    gm.recompile()


def split_graph(gm: fx.GraphModule, splitting_ops: list[str]) -> tuple[fx.GraphModule, list[Piece]]:
    decompose_sizes(gm)
    partition, current = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            current += 1
            partition[node] = current
            current += 1
        elif (
            node.op == "call_function"
            and node.target is operator.getitem
            and node.args[0] in partition
        ):
            partition[node] = partition[node.args[0]]  # keep a getitem with its producer
        else:
            partition[node] = current
    split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces = []
    for name, child in split.named_children():
        is_split = any(is_splitting_node(n, splitting_ops) for n in child.graph.nodes)
        pieces.append(Piece(len(pieces), name, child, is_split))
    return split, pieces


def graph_signature(gm: fx.GraphModule) -> str:
    """A hash of a graph's structure with node names replaced by positions: the pieces
    of two identical decoder layers have the same signature."""
    index: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        args = fx.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        value = node.meta.get("example_value", node.meta.get("val"))
        meta = ""
        if isinstance(value, torch.Tensor):
            meta = f"{value.dtype}{[str(s) for s in value.shape]}{[str(s) for s in value.stride()]}"
        target = "input" if node.op == "placeholder" else str(node.target)
        rows.append(f"{node.op}|{target}|{args}|{meta}")
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()
