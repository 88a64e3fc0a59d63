"""CUDA graphs per padded token count: one wrapper around each compiled piece
(piecewise), and whole decode steps with attention inside (full).

`cudagraph_mode` (vLLM's names): "PIECEWISE" captures the pieces between attention calls;
"FULL_DECODE_ONLY" captures each decode-only step whole (`FullCudaGraph`) and runs other
steps piece by piece without graphs; "FULL_AND_PIECEWISE" does both; "NONE" neither.

Piecewise: on a CUDA device, the first call of a piece at a size in `cudagraph_capture_sizes`
during start-up (the runner's capture phase) runs once to warm up and is then captured
into a graph in one memory pool shared by all pieces; later calls at that size replay
it. The runner pads each batch to the next capture size and runs eagerly above the
largest. Attention runs eagerly between pieces and reads its metadata from persistent
buffers, so replaying the pieces around it is safe. On CPU the wrapper passes through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from compilecore.config import EngineConfig
from compilecore.counters import compilation_counter
from compilecore.forward_context import get_forward_context, is_forward_context_available
from compilecore.recipe import weights_version

logger = logging.getLogger("compilecore")

def piecewise_graphs(mode: str) -> bool:
    return mode in ("PIECEWISE", "FULL_AND_PIECEWISE")


def full_decode_graphs(mode: str) -> bool:
    return mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def graph_pool(engine_config: EngineConfig) -> Any:
    """The engine's CUDA-graph memory pool, made on first use. Per engine, not per
    process: a graph's outputs are held weakly and live in its pool, so two engines
    sharing one could overwrite each other's logits between a replay and its read."""
    cc = engine_config.compilation_config
    if cc.graph_pool is None:
        cc.graph_pool = torch.cuda.graph_pool_handle()
    return cc.graph_pool


def default_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 257, 8))
    return [s for s in sizes if s <= max_num_batched_tokens]


@dataclass
class _Entry:
    graph: Any
    output: Any
    input_ptrs: list[int]
    # Inputs that are not parameters (activations, persistent step buffers): few, so
    # their addresses are checked on every replay; the weights only in debug mode, and
    # their replacement through the registration count.
    moving: list[int]
    weights_version: int


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not own it (vLLM's `weak_ref_tensors`): a
    graph keeps its outputs' addresses, while their memory goes back to the shared pool
    once the caller drops the real tensors, for the next captures to reuse."""
    if t.numel() == 0:
        return t
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    start = t.data_ptr()
    storage = torch._C._construct_storage_from_data_pointer(
        start, t.device, span * t.element_size()
    )
    return torch.empty((), dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def weak_ref_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value)
    if isinstance(value, list | tuple):
        return type(value)(weak_ref_tensors(v) for v in value)
    return value


def _is_activation(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


class CUDAGraphWrapper:
    def __init__(self, runnable: Callable, engine_config: EngineConfig, index: int, token_dim):
        self.runnable = runnable
        self.index = index
        self.token_dim = token_dim
        cc = engine_config.compilation_config
        self.enabled = (
            engine_config.device.type == "cuda"
            and bool(cc.cudagraph_capture_sizes)
            and piecewise_graphs(cc.cudagraph_mode)
        )
        self.sizes = set(cc.cudagraph_capture_sizes or [])
        self.engine_config = engine_config
        self.debug = cc.debug
        self.entries: dict[int, _Entry] = {}

    def _num_tokens(self, args: tuple) -> int | None:
        if self.token_dim is None:
            return None
        i, d = self.token_dim
        return args[i] if d is None else args[i].shape[d]

    def __call__(self, *args: Any) -> Any:
        if not self.enabled:
            return self.runnable(*args)
        extras = get_forward_context().extras if is_forward_context_available() else {}
        if extras.get("full_graph"):  # inside a whole step's capture: no graph in a graph
            return self.runnable(*args)
        n = self._num_tokens(args)
        entry = self.entries.get(n)
        if entry is not None:
            return self._replay(entry, args)
        capturing = extras.get("capturing")
        if n not in self.sizes or not capturing:
            return self.runnable(*args)
        return self._capture(n, args)

    def _capture(self, n: int, args: tuple) -> Any:
        self.runnable(*args)  # warm-up: lazy initialisation must not happen inside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graph_pool(self.engine_config)):
            output = self.runnable(*args)
        ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
        moving = [i for i, a in enumerate(args) if _is_activation(a)]
        # The entry holds weak references; the caller gets the real tensors, so that
        # during capture the allocator frees each output after its last use.
        self.entries[n] = _Entry(graph, weak_ref_tensors(output), ptrs, moving, weights_version())
        compilation_counter.num_cudagraph_captured += 1
        return output

    def _replay(self, entry: _Entry, args: tuple) -> Any:
        # Not an `assert`: under `python -O` a moved input would silently read stale memory.
        for i in entry.moving:
            if args[i].data_ptr() != entry.input_ptrs[i]:
                raise RuntimeError(
                    f"piece {self.index}: input {i} moved since capture; CUDA graph inputs "
                    "must live in persistent buffers"
                )
        if entry.weights_version != weights_version() or self.debug:
            self._check_weights(entry, args)
        entry.graph.replay()
        compilation_counter.num_cudagraph_replays += 1
        return entry.output

    def _check_weights(self, entry: _Entry, args: tuple) -> None:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.data_ptr() != entry.input_ptrs[i]:
                raise RuntimeError(
                    f"piece {self.index}: weight input {i} was replaced after capture; load "
                    "new weights in place (copy_) or build the engine again"
                )
        entry.weights_version = weights_version()


class FullCudaGraph:
    """One decode step captured whole: the pieces, attention between them and the LM
    head, replayed as one graph (one launch from the host where piecewise graphs launch
    each piece and attention's kernels layer by layer). The step must read every input
    from persistent buffers and launch a fixed grid: the runner pads the batch to the
    capture size and gives attention the model's longest context to size its KV splits
    (the kernels read each sequence's real length on the device). The step returns a
    tensor or a tuple of them (the runner's: the logits and the greedy tokens)."""

    def __init__(self, step: Callable[[], Any], engine_config: EngineConfig):
        step()  # warm-up: lazy initialisation and Triton's compiles must not be captured
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=graph_pool(engine_config)):
            output = step()
        # Held weakly: the memory goes back to the shared pool, and the next (smaller)
        # capture's logits reuse it. Held strongly, every size's logits would stay
        # (sizes 1..256 x a 49152-token vocabulary in fp32: ~830 MB).
        self.output = weak_ref_tensors(output)
        compilation_counter.num_full_cudagraph_captured += 1

    def replay(self) -> Any:
        """The step's outputs, in memory that other graphs of the pool reuse: read them
        (or enqueue what reads them) before the next replay of any graph."""
        self.graph.replay()
        compilation_counter.num_full_cudagraph_replays += 1
        return self.output
