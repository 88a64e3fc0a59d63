"""The pass verifier: run a piece's graph before and after a pass on the same random
inputs (symbolic sizes set to a concrete value) and compare every output."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

logger = logging.getLogger("compilecore.passes")

CONCRETE_SIZE = 8
_UNINITIALISED = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
}
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 1e-2}


class PassVerificationError(AssertionError):
    pass


def has_collectives(graph: fx.Graph) -> bool:
    return any(n.op == "call_function" and "_c10d_functional" in str(n.target) for n in graph.nodes)


def _concrete(value, size: int) -> int:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr.subs({s: size for s in expr.free_symbols}))
    return int(value)


def _random_input(value, gen: torch.Generator):
    if isinstance(value, torch.SymInt | int):
        return _concrete(value, CONCRETE_SIZE)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"no example value for a placeholder (got {type(value).__name__})")
    shape = [_concrete(s, CONCRETE_SIZE) for s in value.shape]
    if value.dtype.is_floating_point:
        t = torch.randn(shape, generator=gen) * 0.5
    elif value.dtype == torch.bool:
        t = torch.zeros(shape, dtype=torch.bool)
    else:  # token ids and positions: small, valid for any table
        t = torch.randint(0, CONCRETE_SIZE, shape, generator=gen)
    return t.to(dtype=value.dtype, device=value.device)


def _deterministic_outputs(graph: fx.Graph) -> list[bool]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], tuple | list) else (out.args[0],)
    return [not (isinstance(v, fx.Node) and v.target in _UNINITIALISED) for v in values]


def _mismatch(want: torch.Tensor, got: torch.Tensor, tol: float) -> tuple[float, str] | None:
    """How far `got` is from `want` (and in what), or None when within tolerance. NaN and
    infinities must sit where they sat before: a comparison with NaN is always False, so a
    plain `diff > tol` would let a pass that produces NaN through."""
    w, g = want.float(), got.float()
    if w.numel() == 0:
        return None
    nan_w, nan_g = torch.isnan(w), torch.isnan(g)
    if not torch.equal(nan_w, nan_g):
        return float("inf"), f"NaN at {int((nan_w ^ nan_g).sum())} position(s) that were not"
    inf_w, inf_g = torch.isinf(w), torch.isinf(g)
    if not torch.equal(inf_w, inf_g) or not torch.equal(w[inf_w], g[inf_g]):
        return float("inf"), "infinities differ"
    finite = ~(nan_w | inf_w)
    if not finite.any():
        return None
    diff = (w[finite] - g[finite]).abs().max().item()
    scale = max(w[finite].abs().max().item(), 1.0)
    if diff <= tol * scale:
        return None
    return diff, f"differs by {diff:.3g} (tolerance {tol * scale:.3g})"


def verify_pass(
    name: str,
    before: fx.Graph,
    after: fx.Graph,
    piece: str = "graph",
    example_inputs: Sequence[Any] | None = None,
) -> None:
    """Raise PassVerificationError naming the pass, the piece and the worst output.
    Inputs are random values shaped like the placeholders' fake values; where the graph
    has none (torch 2.11 leaves post-grad placeholders bare), like `example_inputs`, the
    values the piece is compiled with, in placeholder order."""
    gen = torch.Generator().manual_seed(0)
    placeholders = [n for n in before.nodes if n.op == "placeholder"]
    values = [n.meta.get("val") for n in placeholders]
    if any(v is None for v in values) and example_inputs is not None:
        if len(example_inputs) != len(values):
            raise ValueError(
                f"{piece} has {len(values)} inputs, but {len(example_inputs)} example values"
            )
        values = [e if v is None else v for v, e in zip(values, example_inputs)]
    with unset_fake_temporarily(), torch.no_grad():
        inputs = [_random_input(v, gen) for v in values]
        want = fx.GraphModule(torch.nn.Module(), copy.deepcopy(before))(*inputs)
        got = fx.GraphModule(torch.nn.Module(), copy.deepcopy(after))(*inputs)
    want = want if isinstance(want, tuple | list) else (want,)
    got = got if isinstance(got, tuple | list) else (got,)
    checked = _deterministic_outputs(before)
    worst: tuple[float, int, str] | None = None
    for i, (w, g, check) in enumerate(zip(want, got, checked)):
        if not (check and isinstance(w, torch.Tensor)):
            continue
        if not isinstance(g, torch.Tensor) or w.shape != g.shape or w.dtype != g.dtype:
            found = f"{g.dtype}{list(g.shape)}" if isinstance(g, torch.Tensor) else type(g)
            raise PassVerificationError(
                f"pass {name} on {piece}: output {i} changed from {w.dtype}{list(w.shape)} "
                f"to {found}"
            )
        bad = _mismatch(w, g, _TOLERANCE.get(w.dtype, 1e-4))
        if bad is not None and (worst is None or bad[0] > worst[0]):
            worst = (bad[0], i, bad[1])
    if worst is not None:
        raise PassVerificationError(f"pass {name} on {piece}: output {worst[1]} {worst[2]}")
    logger.info("pass %s verified on %s (%d outputs)", name, piece, sum(checked))
