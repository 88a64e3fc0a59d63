"""Copies made from weights (passes/ops/derived.py): one rule for the packed copies and the
LM head's screen. The oracle is a count of how often the copy was made and what it holds:
made once while the weight stands still, made again after every kind of edit, never
served stale, and gone with the weight."""

from __future__ import annotations

import gc

import torch

from passes.ops import derived


def _maker() -> tuple[list[torch.Tensor], object]:
    made: list[torch.Tensor] = []

    def make(w: torch.Tensor) -> torch.Tensor:
        made.append(w.clone())
        return w.clone()

    return made, make


def test_made_once_then_again_after_every_kind_of_edit():
    w = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    made, make = _maker()
    for _ in range(3):
        assert torch.equal(derived.derived(w, "t", make), w)
    assert len(made) == 1
    edits = [
        lambda: w.copy_(torch.randn(8, 4)),  # through torch: the version counter
        lambda: setattr(w, "data", torch.randn(8, 4)),  # new storage: the address
        lambda: w.mul_(2),  # arithmetic under no_grad (a frozen parameter)
        lambda: (w.data.copy_(torch.randn(8, 4)), derived.weights_written()),  # .data
    ]
    for i, edit in enumerate(edits):
        with torch.no_grad():
            edit()
        assert derived.current(w, "t") is None, i  # stale: not served
        assert torch.equal(derived.derived(w, "t", make), w), i
        assert len(made) == i + 2


def test_a_view_made_anew_each_call_shares_its_base_copy():
    """The LM head's rows without padding are a fresh view per call: the copy belongs to
    the viewed tensor (one per view position), a view of all of it is the tensor itself."""
    w = torch.randn(10, 4)
    made, make = _maker()
    for _ in range(3):
        derived.derived(w[:7], "t", make)
    assert len(made) == 1 and made[0].shape == (7, 4)
    derived.derived(w[2:9], "t", make)  # another position: its own copy
    assert len(made) == 2
    derived.derived(w[:10], "t", make)
    assert derived.current(w, "t") is not None and len(made) == 3
    w[0, 0] += 1  # through a view of the base: one counter for all
    assert derived.current(w[:7], "t") is None


def test_kinds_are_kept_apart_and_forgotten_alone():
    w = torch.randn(6, 4)
    a, make_a = _maker()
    b, make_b = _maker()
    derived.derived(w, "a", make_a)
    derived.derived(w[:3], "b", make_b)
    derived.forget("b")
    assert derived.current(w, "a") is not None and derived.current(w[:3], "b") is None


def test_copies_go_with_their_weight():
    w = torch.randn(6, 4)
    made, make = _maker()
    derived.derived(w, "t", make)
    ident = id(w)
    assert ident in derived._COPIES
    del w
    gc.collect()
    assert ident not in derived._COPIES
