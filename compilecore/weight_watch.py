"""One rule for everything made from a model's weights (recorded CPU and CUDA graphs,
packed copies, the LM head's int8 screen): before each step the runner asks its
`WeightWatch` whether any of its model's weights moved since the last step, and records
its graphs again if so; copies made from weights are keyed by the weight's address and
version counter, so they are made again on their next use.

What it notices, per parameter and buffer: the object replaced (`module.weight = ...`,
`load_state_dict(assign=True)`), its storage replaced (`p.data = t`: the address), and
any write through torch to the tensor or a view of it (`copy_`, `load_state_dict`,
arithmetic under `torch.no_grad()`: the tensor's version counter). Torch's `.data` is an
alias with a counter of its own (autograd must not see writes through it), so the watch
makes each parameter it sees a `WatchedParameter`, whose `.data` shares the counter:
`p.data.mul_(2)` is noticed too. A write torch cannot see at all (through a numpy view
or a raw pointer) needs `mark_weights_changed(model)` (`load_weights` calls it), or
`mark_weights_changed()` for every model.

Each watch looks at its own model only: one engine's edits never make another engine
record its graphs again (with a shared count, two engines stepping in one process would
invalidate each other on every step).
"""

from __future__ import annotations

import operator

import torch

from compilecore.recipe import marks, module_marks, note_weights_seen_changed, registrations

_VERSION = operator.attrgetter("_version")


class WatchedParameter(torch.nn.Parameter):
    """A parameter whose `.data` is `detach()`: the same storage and the same version
    counter, so a write through it moves the counter the watch compares. Setting `.data`
    is torch's own (a new storage: the watch sees its address move)."""

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch.nn.Parameter.data.__set__(self, value)


def watch_data_writes(tensors: list[torch.Tensor]) -> None:
    """Every plain parameter among `tensors` becomes a `WatchedParameter` in place (its
    class only: the same object, storage and counter; a subclass of someone else's is left
    as it is)."""
    for t in tensors:
        if type(t) is torch.nn.Parameter:
            t.__class__ = WatchedParameter


class WeightWatch:
    """The identities, addresses and version counters of a module's parameters and
    buffers, checked in one pass (~55 us for the quantized default model's 424 tensors)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.marks = self._marks()
        self._collect()

    def _collect(self) -> None:
        self.registrations = registrations()
        tensors = [*self.module.parameters(), *self.module.buffers()]
        watch_data_writes(tensors)
        self.tensors = tensors
        self.ids = tuple(map(id, tensors))
        # Inference tensors have no version counter (and cannot be written in place
        # outside inference mode); their addresses are still watched.
        self.versioned = [t for t in tensors if not t.is_inference()]
        self.state = self._state()

    def _state(self) -> tuple:
        return tuple(map(_VERSION, self.versioned)), tuple(map(torch.Tensor.data_ptr, self.tensors))

    def check(self) -> bool:
        """Whether any weight of the module was replaced or written since the last check
        (or `mark_weights_changed()` was called)."""
        if self.registrations != registrations():  # some module's tensors were set: ours?
            ids, state = self.ids, self.state
            self._collect()
            changed = self.ids != ids or self.state != state
        else:
            state = self._state()
            changed, self.state = state != self.state, state
        if changed:
            note_weights_seen_changed()
        now = self._marks()
        if self.marks != now:
            self.marks, changed = now, True
        return changed

    def _marks(self) -> tuple[int, int]:
        return marks(), module_marks(self.module)
