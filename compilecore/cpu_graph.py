"""CPU graphs: a forward's native calls recorded once, then replayed by one C call.

The CPU counterpart of CUDA graphs. At a static token count (`compile_sizes`) every
piece is one or more Inductor C++ kernels, attention is a C++ kernel, and everything
between them in Python (piece calls, wrapper frames, buffer allocation, the op's
dispatch) only decides which pointers the kernels get. Those pointers are the same on
every step at that size: weights, the KV cache, the runner's persistent input and
metadata buffers, and the intermediate buffers, which the graph keeps alive. So the
capture runs the forward once with

- every Inductor kernel recorded (its C function and arguments) by the hook the wrapper
  code calls it through (`kernel_call`; our backend has Inductor write its wrappers so,
  `wrapper_codegen.py`),
- every native op (attention, `compilecore.packed_mm`, ...) recorded as the C calls it
  declares next to its registration (`passes.native_calls.declare_entry`), read by
  a dispatch mode that also refuses any other op that computes (an extern GEMM, a
  fallback),

and the replay calls the recorded functions in order from C: no Python between kernels.
(Inductor's `cpp_wrapper` calls its kernels from C, out of sight: the config switches CPU
graphs off with it; its per-piece C++ ran no faster than the Python wrapper:
docs/kernel-choices.md, Inductor's C++ wrapper.) An op may declare a team function
(`NativeCall(team=n)`): a pass over the recording (`cpu_graph_regions.py`) puts each run of such
calls in one OpenMP parallel region of n threads, a barrier between calls, and the replay runs
the regions it formed. At batch 1 the layer ops and the attention between them are team
functions, so the step's middle is one parallel region, not ~90.

Unfused (one decode step at batch 1, SmolLM2: ~130 Python-level calls):

    piece_0(...) -> attention op -> piece_1(...) -> ... -> piece_60(...) -> lm_head(...)

Replayed:

    run_program(program, n)   # n recorded C calls, arguments baked in
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from compilecore.cpu_graph_regions import Region, form_regions, region_stats
from passes import native_calls
from passes.native import declare, load_library

__all__ = ["CpuGraph", "CpuGraphUnsupported", "capture", "is_capturing"]

logger = logging.getLogger("compilecore")

MAX_ARGS = 96  # arguments of one recorded call (Inductor kernels of one piece: ~25)


class CpuGraphUnsupported(RuntimeError):
    """The forward does something a replay could not repeat (the reason says what).
    `transient`: code was compiled during the capture, which the next capture at this
    size will find compiled. `alarming`: not a limit of CPU graphs but a sign that this
    torch's code went around the recording (worth a warning)."""

    def __init__(self, reason: str, transient: bool = False, alarming: bool = False):
        super().__init__(reason)
        self.transient = transient
        self.alarming = alarming


def _executor_source() -> str:
    cases = []
    for n in range(MAX_ARGS + 1):
        params = ", ".join(["i64"] * n)
        args = ", ".join(f"a[{i}]" for i in range(n))
        cases.append(f"    case {n}: reinterpret_cast<void (*)({params})>(fn)({args}); break;")
    body = "\n".join(cases)
    # Every recorded argument is a pointer or an int64: both travel in the same registers
    # (and stack slots) in the x86-64 and AArch64 C calling conventions. The program is
    # regions (`cpu_graph_regions.py`), each [team, calls, words], then its calls; a call's
    # header holds its argument count and, above bit 16, whether a barrier follows it.
    return f"""#include <cstdint>
#include <omp.h>
typedef int64_t i64;
static inline void call(const i64* p) {{
  void* fn = reinterpret_cast<void*>(p[1]);
  const i64* a = p + 2;
  switch (p[0] & 0xffff) {{
{body}
  }}
}}
static inline const i64* next(const i64* p) {{ return p + 2 + (p[0] & 0xffff); }}
// TIMED (`CpuGraph.profile`): t[k] = when call k ended (on the team's first thread, after
// the barrier that follows it or the region's join), t[-1] the start.
template <bool TIMED>
static void run(const i64* p, i64 num_regions, double* t) {{
  i64 k = 0;
  if (TIMED) t[-1] = omp_get_wtime();
  for (i64 r = 0; r < num_regions; ++r) {{
    const i64 team = p[0], num_calls = p[1];
    const i64* calls = p + 3;
    if (team == 0) {{
      for (i64 c = 0; c < num_calls; ++c, calls = next(calls)) {{
        call(calls);
        if (TIMED) t[k++] = omp_get_wtime();
      }}
    }} else {{
#pragma omp parallel num_threads(team)
      {{
        const i64* q = calls;
        for (i64 c = 0; c < num_calls; ++c, q = next(q)) {{
          call(q);
          if (q[0] >> 16) {{
#pragma omp barrier
          }}
          if (TIMED && omp_get_thread_num() == 0) t[k + c] = omp_get_wtime();
        }}
      }}
      if (TIMED) {{
        k += num_calls;
        t[k - 1] = omp_get_wtime();  // the region's last call ends at its join
      }}
    }}
    p += 3 + p[2];
  }}
}}
extern "C" void run_program(const i64* p, i64 num_regions) {{
  run<false>(p, num_regions, nullptr);
}}
extern "C" void run_program_timed(const i64* p, i64 num_regions, double* t) {{
  run<true>(p, num_regions, t + 1);
}}
"""


@functools.cache
def _executor(root: Path) -> Any:
    flags = ["-O2", "-fopenmp", "-shared", "-fPIC"]
    lib = load_library(_executor_source(), "cpu_graph", root, flags)
    return declare(lib, "run_program(ptr, i64)", "run_program_timed(ptr, i64, ptr)")


class _Capture:
    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], int]] = []
        self.described: list[CallInfo] = []
        self.keep: list[Any] = []
        self.checks: list[Callable[[], str | None]] = []
        self.failure: str | None = None

    def record(
        self,
        address: int,
        args: Sequence[Any],
        what: str,
        keep: Sequence[Any] = (),
        check: Callable[[], str | None] | None = None,
        team: int = 0,
        source: str = "",
    ) -> None:
        self.keep.extend(keep)
        if check is not None and check not in self.checks:
            self.checks.append(check)
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                self.keep.append(a)  # the replay writes and reads this memory: keep it
                values.append(a.data_ptr())
            elif isinstance(a, (bool, int)):
                values.append(int(a))
            else:
                self.fail(f"{what} takes a {type(a).__name__} argument")
                return
        if len(values) > MAX_ARGS:
            self.fail(f"{what} takes {len(values)} arguments (at most {MAX_ARGS})")
        self.calls.append((address, values, team))
        shapes = [_shape(a) for a in args if isinstance(a, torch.Tensor)]
        self.described.append(CallInfo(what, team, shapes, source or what))

    def fail(self, reason: str) -> None:
        self.failure = self.failure or reason


class CallInfo(NamedTuple):
    """A recorded call, for readers: what recorded it, its team size (0: plain), its
    tensor arguments' shapes and where in the forward it came from (the op and its string
    arguments, or the Inductor kernel's name in its wrapper module)."""

    what: str
    team: int
    shapes: list[str]
    source: str


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) + " " + str(t.dtype).removeprefix("torch.")


def _is_inductor_kernel(value: Any) -> bool:
    return (
        type(value).__name__ == "builtin_function_or_method"
        and value.__name__ == "kernel"
        and str(getattr(getattr(value, "__self__", None), "__file__", "")).endswith(".so")
    )


@functools.cache
def _kernel_address(path: str) -> int:
    # The module's shared object also exports the C entry point (`extern "C" kernel`).
    return ctypes.cast(ctypes.CDLL(path).kernel, ctypes.c_void_p).value


def kernel_call(kernel: Any, *args: Any) -> Any:
    """How the wrapper code our backend has Inductor write calls each C++ kernel
    (`wrapper_codegen.py`): recorded when this thread is capturing, then called."""
    if _CAPTURES:  # one truth test when nothing captures: every compiled step comes here
        capture = getattr(_ACTIVE, "capture", None)
        if capture is not None and _is_inductor_kernel(kernel):
            path = kernel.__self__.__file__
            what = f"Inductor kernel {Path(path).stem[:12]}"
            capture.record(_kernel_address(path), args, what, source=_kernel_name(kernel))
    return kernel(*args)


def _kernel_name(kernel: Any) -> str:
    """The name the wrapper module that called `kernel` gives it (Inductor's
    `cpp_fused_...`), and that module's file; capture time only."""
    frame = sys._getframe(2)  # kernel_call's caller: the wrapper's `call`
    name = next((k for k, v in frame.f_globals.items() if v is kernel), "kernel")
    return f"{name} ({Path(frame.f_code.co_filename).name})"


def _inductor_modules() -> list[Any]:
    from torch._inductor.codecache import PyCodeCache

    return list(getattr(PyCodeCache, "modules", []))


class _RefuseCompute(TorchDispatchMode):
    """Aten ops that only allocate or view are fine; any other op is recorded as the C
    calls it declares (`passes.native_calls.declare_entry`); anything else computes outside the
    recording."""

    ALLOCATE = ("empty_strided", "empty", "as_strided", "alias", "detach", "lift_fresh")

    def __init__(self, capture: _Capture):
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if getattr(func, "namespace", "aten") not in ("aten", "prims"):
            self._record_declared(func, args, kwargs or {}, out)
        elif not (getattr(func, "is_view", False) or name in self.ALLOCATE):
            self.capture.fail(f"{func} computes outside a recorded kernel")
        return out

    def _record_declared(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        entry = native_calls.native_entry(func._schema.name)
        if entry is None:
            return self.capture.fail(f"{func} declares no native call (passes.native)")
        rest = func._schema.arguments[len(args) :]
        full = (*args, *(kwargs[a.name] for a in rest if a.name in kwargs))
        try:
            calls = entry(full, out)
        except native_calls.Unrecordable as exc:
            return self.capture.fail(str(exc))
        if calls is None:
            return self.capture.fail(f"{func} ran its torch reference, not its C kernel")
        strings = [a for a in full if isinstance(a, str)]  # an attention layer's name
        source = func._schema.name + (f" ({', '.join(strings)})" if strings else "")
        for call in (calls,) if isinstance(calls, native_calls.NativeCall) else calls:
            self.capture.record(call.address, call.args, call.what, call.keep, call.check,
                                call.team, source)  # fmt: skip


# This thread's capture in progress, if any. Captures on two threads do not meet: each
# records its own thread's kernel calls, and dispatch modes are per thread.
_ACTIVE = threading.local()
_CAPTURES: list[_Capture] = []  # every thread's, for `kernel_call`'s quick test


def is_capturing() -> bool:
    """Whether this thread is capturing a CPU graph."""
    return getattr(_ACTIVE, "capture", None) is not None


def capture(fn: Callable[[], Any], cache_root: Path) -> tuple[Any, CpuGraph]:
    """Run `fn` once (its result is real) and record it; (result, graph). Raises
    CpuGraphUnsupported, naming what could not be recorded."""
    if is_capturing():
        raise RuntimeError("a CPU graph capture is already running")
    _ACTIVE.capture = cap = _Capture()
    _CAPTURES.append(cap)
    try:
        return _capture(fn, cap, cache_root)
    finally:
        _ACTIVE.capture = None
        _CAPTURES.remove(cap)


class _KernelsRun:
    """Counts the Inductor kernels this thread calls, through the hook or not (the
    profiler's C-call events): the recording must hold as many. A torch whose wrapper
    calls kernels some other way than `wrap_kernel_call` would otherwise leave them out
    of the graph silently (tests/test_cpu_graph.py, the pass-through hook)."""

    def __enter__(self) -> _KernelsRun:
        self.count, self.saved = 0, sys.getprofile()
        sys.setprofile(self._event)
        return self

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and _is_inductor_kernel(arg):
            self.count += 1
        if self.saved is not None:
            self.saved(frame, event, arg)

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self.saved)


def _capture(fn: Callable[[], Any], cap: _Capture, cache_root: Path) -> tuple[Any, CpuGraph]:
    known = len(_inductor_modules())
    with _RefuseCompute(cap), _KernelsRun() as ran:
        result = fn()
    recorded = sum(info.what.startswith("Inductor kernel") for info in cap.described)
    if cap.failure is None and ran.count != recorded:
        raise CpuGraphUnsupported(
            f"{ran.count} Inductor kernels ran and {recorded} were recorded: torch "
            f"{torch.__version__}'s wrapper calls kernels around compilecore's hook "
            "(compilecore/wrapper_codegen.py)",
            alarming=True,
        )
    # Something compiled during the capture (its own ops ran, or its code had not run
    # before): the next capture at this size finds it compiled.
    transient = len(_inductor_modules()) > known
    if cap.failure is None and not cap.calls:
        cap.fail("nothing was recorded")
    if cap.failure is not None:
        raise CpuGraphUnsupported(cap.failure, transient)
    graph = CpuGraph(cap.calls, cap.keep, result, _executor(cache_root), cap.checks)
    graph.described = cap.described
    return result, graph


class CpuGraph:
    """A recorded forward. `replay()` reruns it on whatever the captured input buffers
    hold now and returns the captured outputs (rewritten in place)."""

    def __init__(
        self,
        calls: list[tuple[int, list[int], int]],
        keep: list,
        outputs: Any,
        run: Any,  # the executor library: run_program, run_program_timed
        checks: Sequence[Callable[[], str | None]] = (),
    ):
        # The pass decides the regions; the program encodes them for the executor.
        self.regions: list[Region] = form_regions([team for _, _, team in calls])
        flat: list[int] = []
        for region in self.regions:
            body: list[int] = []
            for c, barrier in zip(region.calls, region.barriers):
                address, args, _ = calls[c]
                body += [len(args) | int(barrier) << 16, address, *args]
            flat += [region.team, len(region.calls), len(body), *body]
        self.program = torch.tensor(flat, dtype=torch.int64)
        self.num_calls = len(calls)
        self.keep, self.outputs, self._run = keep, outputs, run
        self.checks = tuple(checks)
        self._program_ptr = self.program.data_ptr()
        self.described: list[CallInfo] = []  # per call, set by capture

    def program_text(self) -> str:
        """The program the replay runs, one line per call: its place, its region (plain, or
        a team's, a barrier after it or not), what recorded it, where in the forward it came
        from and the shapes of its tensor arguments."""
        lines = [f"# {self!r}: {region_stats(self.regions)}"]
        for r, region in enumerate(self.regions):
            for c, barrier in zip(region.calls, region.barriers):
                info = self.described[c]
                where = f"region {r} " + (f"(team of {region.team})" if region.team else "(plain)")
                where += ", barrier after" if barrier else ""
                lines.append(f"{c:4d}  {where:<36}  {info.what} <- {info.source}  "
                             f"({', '.join(info.shapes)})")  # fmt: skip
        return "\n".join(lines) + "\n"

    def program_data(self) -> dict[str, Any]:
        """The same as data (a dump's report.json): the regions and each call."""
        return {
            "stats": region_stats(self.regions),
            "regions": [
                {"team": r.team, "calls": list(r.calls), "barriers_after": list(r.barriers)}
                for r in self.regions
            ],
            "calls": [info._asdict() for info in self.described],
        }

    def replay(self) -> Any:
        self._run.run_program(self._program_ptr, len(self.regions))
        for check in self.checks:  # a recorded call that can fail reports it here
            if (reason := check()) is not None:
                raise RuntimeError(f"CPU graph replay failed: {reason}")
        return self.outputs

    def profile(self, replays: int = 20) -> list[tuple[CallInfo, float]]:
        """Each recorded call with its median microseconds over `replays` replays (timed
        inside the replay, between the barriers that follow calls: the time the team spent
        on that call, its wait for the slowest thread included). The replays rewrite the
        outputs (and the KV slots of the recorded step) as `replay` does."""
        times = torch.zeros(replays, self.num_calls + 1, dtype=torch.float64)
        for r in range(replays):
            self._run.run_program_timed(self._program_ptr, len(self.regions),
                                        times[r].data_ptr())  # fmt: skip
        us = (times[:, 1:] - times[:, :-1]).median(0).values * 1e6
        return list(zip(self.described, us.tolist()))

    def __repr__(self) -> str:
        return f"CpuGraph({self.num_calls} calls, {len(self.keep)} buffers)"
