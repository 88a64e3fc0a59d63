"""What the compiler did, counted: tests assert on these, and logs report them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0  # decorated modules that compiled (first call)
    num_graphs_seen: int = 0  # Dynamo graphs handed to our backend
    num_piecewise_graphs_seen: int = 0  # pieces after the split, attention included
    num_piecewise_capturable_graphs_seen: int = 0  # pieces compiled (and captured on GPU)
    num_backend_compilations: int = 0  # piece compiles asked for (after de-duplication)
    num_inductor_compiles: int = 0  # real Inductor compiles
    num_cache_hits: int = 0  # pieces loaded from the on-disk compile cache
    num_cache_misses: int = 0
    num_cache_errors: int = 0  # corrupt or unreadable entries, recompiled
    num_recompiles: int = 0  # Dynamo traces beyond the first of a model (debug mode raises)
    num_cudagraph_captured: int = 0
    num_cudagraph_replays: int = 0  # piece replays (a CUDA graph step replays each piece)
    num_full_cudagraph_captured: int = 0  # whole decode steps captured (cudagraph_mode FULL*)
    num_full_cudagraph_replays: int = 0
    num_cpu_graph_replays: int = 0  # whole decode steps replayed from a recorded CPU graph
    num_warm_starts: int = 0  # forwards started from a saved recipe, without Dynamo

    def clone(self) -> CompilationCounter:
        return dataclasses.replace(self)

    @contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the named counters move by exactly these amounts in the block."""
        unknown = set(deltas) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown counters: {sorted(unknown)}")
        before = self.clone()
        yield
        wrong = {
            name: (getattr(self, name) - getattr(before, name), want)
            for name, want in deltas.items()
            if getattr(self, name) - getattr(before, name) != want
        }
        if wrong:
            detail = ", ".join(
                f"{n}: moved {got}, expected {want}" for n, (got, want) in wrong.items()
            )
            raise AssertionError(f"compilation counters: {detail}")


compilation_counter = CompilationCounter()
