"""The parallel regions of a CPU graph: a pass over the recorded calls, whose output is the
program the replay runs (`cpu_graph.py`); the executor decides nothing.

Ops may declare team functions (`NativeCall(team=n)`): C functions that split their work
by `omp_get_thread_num()` on a team of n threads. Waking an OpenMP team costs a few
microseconds; a batch-1 decode step makes ~90 team calls. So consecutive team calls of one
team size share one region, with a barrier after each call but the last (each reads what
the one before it wrote; the region's end joins the team). Plain calls (Inductor's
kernels, which open their own `#pragma omp parallel`) run between regions on the calling
thread. For one batch-1 layer:

    recorded:  kernel | qkv(team 2) | rope(team 2) | attention(team 2) | o_proj(team 2) | kernel
    regions:   plain [kernel] | team 2 [qkv, B, rope, B, attention, B, o_proj] | plain [kernel]

The regions, as data (`Region`), are written into every dump with the call each
instruction came from (`compilecore/dump.py`: `cpu_graphs/size_N.txt`, report.json).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """Calls the replay makes together: `team` 0 for plain calls on the calling thread,
    else one OpenMP parallel region of `team` threads in which every thread makes every
    call. `calls`: indices into the recording; `barriers[i]`: a team barrier after call i."""

    team: int
    calls: tuple[int, ...]
    barriers: tuple[bool, ...]


def form_regions(teams: Sequence[int]) -> list[Region]:
    """The regions for recorded calls whose team sizes are `teams` (0: a plain call)."""
    regions: list[Region] = []
    start = 0
    for i in range(1, len(teams) + 1):
        if i < len(teams) and teams[i] == teams[start]:
            continue
        calls = tuple(range(start, i))
        barriers = tuple(bool(teams[start]) and c != i - 1 for c in calls)
        regions.append(Region(teams[start], calls, barriers))
        start = i
    return regions


def region_stats(regions: Sequence[Region]) -> dict[str, int]:
    """What the pass formed (the dump's report): regions opened, calls inside them, plain
    calls, barriers."""
    team = [r for r in regions if r.team]
    return {
        "parallel_regions": len(team),
        "team_calls": sum(len(r.calls) for r in team),
        "plain_calls": sum(len(r.calls) for r in regions if not r.team),
        "barriers": sum(sum(r.barriers) for r in regions),
    }
