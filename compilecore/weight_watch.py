"""One rule for everything made from a model's weights (recorded CPU and CUDA graphs,
packed copies, the LM head's int8 screen): before each step the runner asks its
`WeightWatch` whether anything its graphs hold may be stale, and records its graphs again
if so; copies made from weights are keyed by the weight's address and version counter, so
they are made again on their next use. Graphs read weights by address: a write in place
reaches them as it is, so a step needs only the copies' states (passes/ops/derived.py
`stale`) and whether an address moved, not all 424 of the default model's version
counters (read right after a replay has streamed the weights through the caches, those
took ~0.5 ms a step, ~7% of it: benchmarks/bench_host.py).

What it notices, per parameter and buffer: the object replaced (`module.weight = ...`,
`load_state_dict(assign=True)`), its storage replaced (`p.data = t`: counted by the
watch's parameters, the address compared then; a buffer's address every step), and any
write through torch to a tensor a copy was made from or a view of it (`copy_`,
`load_state_dict`, arithmetic under `torch.no_grad()`: the tensor's version counter).
Torch's `.data` is an alias with a counter of its own (autograd must not see writes
through it), so the watch makes each parameter it sees a `WatchedParameter`, whose `.data`
shares the counter: `p.data.mul_(2)` is noticed too. A write torch cannot see at all
(through a numpy view or a raw pointer) needs `mark_weights_changed(model)`
(`load_weights` calls it), or `mark_weights_changed()` for every model.

Each watch looks at its own model only: one engine's edits never make another engine
record its graphs again (with a shared count, two engines stepping in one process would
invalidate each other on every step).
"""

from __future__ import annotations

import torch

from compilecore.recipe import marks, module_marks, note_weights_seen_changed, registrations
from passes.ops import derived

# `.data = t` on any WatchedParameter so far: only then can a watched parameter's address
# move, so a step compares the addresses of the other tensors only.
_DATA_SETS = [0]


class WatchedParameter(torch.nn.Parameter):
    """A parameter whose `.data` is `detach()`: the same storage and the same version
    counter, so a write through it moves the counter its copies are keyed by. Setting
    `.data` is torch's own (a new storage), counted so the watch compares addresses."""

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch.nn.Parameter.data.__set__(self, value)
        _DATA_SETS[0] += 1


def watch_data_writes(tensors: list[torch.Tensor]) -> None:
    """Every plain parameter among `tensors` becomes a `WatchedParameter` in place (its
    class only: the same object, storage and counter; a subclass of someone else's is left
    as it is)."""
    for t in tensors:
        if type(t) is torch.nn.Parameter:
            t.__class__ = WatchedParameter


class WeightWatch:
    """The identities and addresses of a module's parameters and buffers, and the states
    of the copies made from them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.marks = self._marks()
        self._collect()
        self._reported = derived.stale(self.id_set)  # stale copies already reported

    def _collect(self) -> None:
        self.registrations = registrations()
        tensors = [*self.module.parameters(), *self.module.buffers()]
        watch_data_writes(tensors)
        self.tensors = tensors
        self.ids = tuple(map(id, tensors))
        self.id_set = frozenset(self.ids)
        self.unwatched = [t for t in tensors if type(t) is not WatchedParameter]
        self.data_sets = _DATA_SETS[0]
        self.addresses = tuple(map(torch.Tensor.data_ptr, self.tensors))
        self.state = self._state()

    def _state(self) -> tuple:
        """Each step: the addresses of what no `.data` setter reports."""
        return tuple(map(torch.Tensor.data_ptr, self.unwatched))

    def check(self) -> bool:
        """Whether anything the module's graphs hold may be stale since the last check: a
        weight replaced or moved to another address, a copy made from a weight written
        since, or `mark_weights_changed()`. (A weight written in place is read as it is by
        every graph, which holds its address.)"""
        if self.registrations != registrations():  # some module's tensors were set: ours?
            ids, addresses = self.ids, self.addresses
            self._collect()
            changed = self.ids != ids or self.addresses != addresses
        else:
            state = self._state()
            changed, self.state = state != self.state, state
            if self.data_sets != _DATA_SETS[0]:  # some parameter's `.data` was set
                addresses = tuple(map(torch.Tensor.data_ptr, self.tensors))
                changed = changed or addresses != self.addresses
                self.addresses, self.data_sets = addresses, _DATA_SETS[0]
        # A copy made from one of our weights that was written since: graphs may hold it.
        # Reported once (a copy no graph uses stays stale until its next use).
        stale = derived.stale(self.id_set)
        changed = changed or bool(stale - self._reported)
        self._reported = stale
        if changed:
            note_weights_seen_changed()
        now = self._marks()
        if self.marks != now:
            self.marks, changed = now, True
        return changed

    def _marks(self) -> tuple[int, int]:
        return marks(), module_marks(self.module)
