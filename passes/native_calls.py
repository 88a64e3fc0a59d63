"""Declared C calls: an op that runs C code through ctypes declares, next to its
registration (`declare_entry`), the call it makes for given arguments and outputs, as data
(`NativeCall`: the function's address and its integer or tensor arguments). The op makes
its call through the same declaration; `compilecore.cpu_graph` reads it while it records a
forward and replays the calls later without Python. An op never knows whether it is being
recorded.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Unrecordable(RuntimeError):
    """Raised by an op's declared entry for arguments whose call a recording could not
    repeat (the message says why, e.g. an input the kernel can only read through a copy the
    op makes per call)."""


class NativeCall(NamedTuple):
    """One call of a C function: its address and its integer or tensor arguments. `team`:
    0 for a plain call, else the size of the OpenMP team it runs in as a team function (it
    splits its work by `omp_get_thread_num()` and may use orphaned barriers; a replay runs
    a run of such calls in one team, a barrier after each). `eager`: how the op makes the
    call itself (the same arguments, then the team size for a team function; None where the
    op makes it another way). `keep`: objects a recording must hold while it lives (what
    integer arguments point into); `check`: run after each replay, returns why the replay
    failed or None."""

    address: int
    args: tuple
    what: str
    team: int
    eager: Any
    keep: tuple = ()
    check: Callable[[], str | None] | None = None

    def run(self) -> None:
        """Make the call now (a team function in a region of its own)."""
        ints = [a.data_ptr() if hasattr(a, "data_ptr") else int(a) for a in self.args]
        if self.team:
            self.eager(*ints, self.team)
        else:
            self.eager(*ints)


# "namespace::op" -> entry(args, outputs): the C calls an op makes for these arguments and
# outputs (a NativeCall, a sequence of them, or None where it ran its torch reference).
# Declared next to each op's registration; a CPU graph capture reads it, so the op itself
# never knows whether it is recorded.
Entry = Callable[[tuple, Any], "NativeCall | Sequence[NativeCall] | None"]
_ENTRIES: dict[str, Entry] = {}


def declare_entry(op: str, entry: Entry) -> None:
    """Declare the C call(s) op `op` ("compilecore::linear") makes, as a function of its
    arguments and its outputs; the same function the op itself uses to make the call. The
    entry raises `Unrecordable` for arguments a recording could not repeat."""
    _ENTRIES[op] = entry


def native_entry(op: str) -> Entry | None:
    return _ENTRIES.get(op)


def function_address(fn: Any) -> int:
    """The address of a ctypes function (a `NativeCall`'s `address`)."""
    return ctypes.cast(fn, ctypes.c_void_p).value
