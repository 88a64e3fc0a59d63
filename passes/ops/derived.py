"""Copies made from a weight (the packed layout of `packed_mm`, the LM head's int8 screen),
under one rule: each belongs to its weight tensor, is made on first use, is made again when
the tensor's storage or version counter moves (`p.data = t`, `copy_`, `load_state_dict`,
arithmetic under `torch.no_grad()`) or after `weights_written()` (a write through `.data`,
which moves no counter), and goes when the tensor goes.

Before there were two rules: packed copies keyed by the tensor, the screen by its address
with eight sampled rows compared to tell a freed head from a new one at the same address.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

# id(weight) -> (weak reference to it, {kind or (kind, view): (the state when made, the copy)}).
# A plain dict keyed by id (checked against the weak reference) is ~4x cheaper to look up
# than a WeakKeyDictionary, and an eager batched step looks up 121 weights.
_COPIES: dict[int, tuple[weakref.ref, dict[Hashable, tuple[tuple, Any]]]] = {}
_WRITES = [0]  # weights_written() calls


def version_counter(t: torch.Tensor) -> int:
    """t's version counter (moved by every write through torch), which copies made from
    a weight are keyed by; 0 for an inference tensor (no counter, never written in place
    outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return 0


def weights_written() -> None:
    """Weights were written where no version counter sees it (through `.data`): every
    copy is made again at its next use."""
    _WRITES[0] += 1


def _state(w: torch.Tensor) -> tuple:
    return w.data_ptr(), version_counter(w), _WRITES[0]


def _owner(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, Hashable]:
    """Who holds w's copy, under which key: a view's (the LM head's rows without the
    vocabulary's padding, made anew each call) belongs to the tensor it views, keyed by
    where the view sits in it; views share their base's version counter."""
    base = w._base
    if base is None:
        return w, kind
    where = (w.storage_offset(), w.shape, w.stride())
    if where == (base.storage_offset(), base.shape, base.stride()):
        return base, kind  # a view of all of it is it
    return base, (kind, *where)


def _copies(owner: torch.Tensor, make: bool) -> dict[Hashable, tuple[tuple, Any]] | None:
    ident = id(owner)
    entry = _COPIES.get(ident)
    if entry is None or entry[0]() is not owner:
        if not make:
            return None
        ref = weakref.ref(owner, lambda _, ident=ident: _COPIES.pop(ident, None))
        entry = _COPIES[ident] = (ref, {})
    return entry[1]


def derived(w: torch.Tensor, kind: str, make: Callable[[torch.Tensor], Any]) -> Any:
    """w's copy of this kind, made by `make(w)` (under no_grad) if w has none that is
    current."""
    owner, key = _owner(w, kind)
    copies, state = _copies(owner, True), _state(w)
    held = copies.get(key)
    if held is None or held[0] != state:
        with torch.no_grad():
            held = copies[key] = (state, make(w))
    return held[1]


def current(w: torch.Tensor, kind: str) -> Any | None:
    """w's copy of this kind if it has one that is current, else None (nothing is made)."""
    owner, key = _owner(w, kind)
    copies = _copies(owner, False)
    held = None if copies is None else copies.get(key)
    return held[1] if held is not None and held[0] == _state(w) else None


def stale(ids: frozenset[int]) -> frozenset[tuple]:
    """The copies of tensors among `ids` (by id) that no longer match their tensor: written
    in place (its version counter moved) or `weights_written()` since they were made. Each
    as (tensor id, key, its state when made), so a copy made again is a new entry."""
    found = []
    for ident in ids & _COPIES.keys():
        ref, copies = _COPIES[ident]
        owner = ref()
        if owner is None:
            continue
        now = (version_counter(owner), _WRITES[0])
        found += [(ident, key, state) for key, (state, _) in copies.items() if state[1:] != now]
    return frozenset(found)


def forget(kind: str | None = None) -> None:
    """Drop every copy (of one kind): they are made again at their next use."""
    for _, copies in _COPIES.values():
        for key in [k for k in copies if kind in (None, k if isinstance(k, str) else k[0])]:
            del copies[key]
