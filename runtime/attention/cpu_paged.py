"""The CPU attention backend: KV writes and decode attention in C++ (`cpu_kernels.cpp`),
prefill chunks in C++ with AVX2 or AVX-512 (`cpu_prefill.cpp`: ~3.7x SDPA's speed at 512
tokens in bf16 dot products), elsewhere through the torch backend's SDPA path.

Decode is where the torch backend loses on a CPU: it gathers every sequence's K/V into a
padded [batch, max_len] copy per layer, then runs batched matmuls over the padding. The
kernel reads K/V rows in place through the block table, once per group of query heads,
with an online softmax in fp32, one task per (sequence, KV head).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from passes import native_calls
from passes.native_calls import NativeCall
from runtime.attention.cpu_build import load_cpu_kernels, load_prefill_kernel
from runtime.attention.metadata import AttentionMetadata
from runtime.attention.torch_paged import (
    ROWS_AS_DECODES,
    TorchPagedAttentionBackend,
    _plan,
    _StepPlan,
)

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Below this many (sequence, KV head, token) triples, one thread beats waking the pool. Batch-1
# decode of SmolLM2 (3 KV heads) goes parallel from 64 tokens on: the kernel then splits the
# sequence so both threads work (docs/kernel-choices.md, Decode attention). Eager steps only: a
# CPU graph replays decode in a team already awake.
PARALLEL_MIN_WORK = 192


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [tokens, heads * head_size] view whose rows are contiguous."""
    if t.dim() != 2:
        t = t.reshape(t.shape[0], -1)
    return t if t.stride(1) == 1 else t.contiguous()


@dataclass
class _Bound:
    """One layer's kernels and cache pointers (fixed while its KV cache is)."""

    cache: torch.Tensor
    write: Any
    decode: Any
    team_write: Any  # the same calls as team functions, for CPU graphs (integer arguments)
    team_decode: Any
    prefill: Any  # cpu_prefill.cpp's chunk kernel (None without one)
    scale: torch.Tensor  # the softmax scale as a tensor, for team_decode
    k_cache: int
    v_cache: int
    row: int  # elements per cache slot
    shape: tuple[int, int, int, int, float]  # heads, KV heads, head size, block size, scale


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    """`invariant` (batch-invariant mode): a sequence's split-KV parts depend on its own
    length only, and each row of a query of at most ROWS_AS_DECODES tokens attends in the
    call a decode at its position makes, so no row's bits depend on the batch
    (tests/test_batch_invariant.py)."""

    name = "cpu"

    def __init__(
        self, num_threads: int | None = None, cache_dir: Path | None = None, invariant=False
    ):
        self.lib = load_cpu_kernels(cache_dir)
        self.prefill_lib = load_prefill_kernel(cache_dir)
        self.num_threads = num_threads or torch.get_num_threads()
        self.invariant = invariant
        # The kernels' rule for parts: 0 picks them for the batch; n > 0, at most n for
        # each sequence, from its length.
        self.max_parts = self.num_threads if invariant else 0
        self._bound: dict[int, _Bound | None] = {}

    def supports(self, layer, kv_cache: torch.Tensor) -> bool:
        """The kernel's limits: fp32/bf16 CPU caches, head size <= 512, bounded groups."""
        group = layer.num_heads // layer.num_kv_heads
        return (
            kv_cache.device.type == "cpu"
            and kv_cache.dtype in _SUFFIX
            and kv_cache.is_contiguous()
            and layer.head_size <= 512
            and group <= self.lib.max_group()
            and group * layer.head_size <= self.lib.max_group_dims()
        )

    def _bind(self, layer) -> _Bound | None:
        kv_cache = layer.kv_cache
        if not self.supports(layer, kv_cache):
            return None
        suffix = _SUFFIX[kv_cache.dtype]
        k_cache = kv_cache.data_ptr()
        return _Bound(
            cache=kv_cache,
            write=getattr(self.lib, f"write_kv_{suffix}"),
            decode=getattr(self.lib, f"decode_{suffix}"),
            team_write=getattr(self.lib, f"write_kv_team_{suffix}"),
            team_decode=getattr(self.lib, f"decode_team_{suffix}"),
            prefill=self.prefill_lib and getattr(self.prefill_lib, f"prefill_{suffix}"),
            scale=torch.tensor([layer.scale], dtype=torch.float32),
            k_cache=k_cache,
            v_cache=k_cache + kv_cache[0].numel() * kv_cache.element_size(),
            row=layer.num_kv_heads * layer.head_size,
            shape=(
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_size,
                kv_cache.shape[2],
                layer.scale,
            ),  # fmt: skip
        )

    def forward(self, layer, q, k, v, output, attn_metadata: AttentionMetadata) -> None:
        meta = attn_metadata
        if meta is None:  # compiling or profiling: no batch, maybe no cache yet
            return super().forward(layer, q, k, v, output, meta)
        bound = self._bound.get(id(layer))
        if bound is None or bound.cache is not layer.kv_cache:
            bound = self._bound[id(layer)] = self._bind(layer)
        if bound is None or q.dtype != bound.cache.dtype:
            return super().forward(layer, q, k, v, output, meta)
        step = meta.cache.get("cpu_paged")
        if step is None:
            step = meta.cache["cpu_paged"] = self._step(meta, layer, bound.cache)
        if step.num_tokens:
            k, v = _rows(k), _rows(v)  # row r of k[:n] is row r of k: no slicing needed
            bound.write(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), bound.k_cache,
                        bound.v_cache, step.slots, step.num_tokens, bound.row)  # fmt: skip
        q = _rows(q)
        for run in step.runs:
            bound.decode(q[run.first].data_ptr(), q.stride(0), bound.k_cache, bound.v_cache,
                         run.block_table.data_ptr(), run.block_table.stride(0),
                         run.seq_lens.data_ptr(), output[run.first].data_ptr(),
                         output.stride(0), run.num_rows, *bound.shape, step.threads,
                         self.max_parts)  # fmt: skip
        for chunk in step.chunks:
            done = bound.prefill(q[chunk.start].data_ptr(), q.stride(0), bound.k_cache,
                                 bound.v_cache, chunk.block_table.data_ptr(), chunk.context,
                                 chunk.rows, output[chunk.start].data_ptr(), output.stride(0),
                                 *bound.shape[:4], bound.shape[4], self.num_threads)  # fmt: skip
            if not done:  # never leave the rows unwritten
                raise RuntimeError(f"cpu_prefill.cpp has no kernel for head size {layer.head_size}")
        if step.prefill is not None:
            self._prefill(layer, q, bound.cache, output, step.prefill)

    def native_calls(self, layer, q, k, v, output, meta) -> tuple[NativeCall, ...] | None:
        """The calls `forward` made for this step, as team functions for a CPU graph (the
        attention op's declared entry asks for them): the replay reads the step's lengths and
        tables from the same metadata buffers, and runs these calls and the layer ops
        between them in one OpenMP team (compilecore/cpu_graph.py), so decode splits over
        the threads at any length (no pool to wake per call). None where `forward` ran the
        torch backend's Python."""
        bound = self._bound.get(id(layer))
        if meta is None or bound is None or q.dtype != bound.cache.dtype:
            return None
        step = meta.cache["cpu_paged"]
        rows = {name: _rows(t) for name, t in (("q", q), ("k", k), ("v", v))}
        if step.prefill is not None or step.chunks:
            raise native_calls.Unrecordable("CPU attention: prefill chunks are eager calls")
        if [run.first for run in step.runs] not in ([], [0]):
            raise native_calls.Unrecordable("CPU attention: rows attend as decodes per query")
        if any(rows[n].data_ptr() != t.data_ptr() for n, t in (("q", q), ("k", k), ("v", v))):
            raise native_calls.Unrecordable("CPU attention: q/k/v rows are copied per call")
        q, k, v = rows["q"], rows["k"], rows["v"]
        address, team, calls = native_calls.function_address, self.num_threads, []
        if step.num_tokens:
            calls.append(NativeCall(
                address(bound.team_write),
                (k, k.stride(0), v, v.stride(0), bound.k_cache, bound.v_cache,
                 step.keep[0], step.num_tokens, bound.row),
                "CPU attention (KV write)", team, None,
            ))  # fmt: skip
        for run in step.runs:
            # Split-KV parts' softmax states, until their merge: the layers run one after
            # another, so the step's layers share one buffer.
            size = self.lib.decode_team_states(run.num_rows, *bound.shape[:3])
            if step.states is None or step.states.numel() < size:
                step.states = torch.empty(size)
            calls.append(NativeCall(
                address(bound.team_decode),
                (q, q.stride(0), bound.k_cache, bound.v_cache, run.block_table,
                 run.block_table.stride(0), run.seq_lens, output, output.stride(0),
                 run.num_rows, *bound.shape[:4], bound.scale, step.states, self.max_parts),
                "CPU attention (decode)", team, None,
            ))  # fmt: skip
        return tuple(calls)

    def _step(self, meta: AttentionMetadata, layer, kv_cache: torch.Tensor) -> _Step:
        """What every layer of a step passes the kernels (worked out on the first layer)."""
        slots = meta.slot_mapping[: meta.num_actual_tokens].contiguous()
        runs = self._runs(meta)
        rows = sum(run.num_rows for run in runs)
        work = rows * layer.num_kv_heads * meta.max_seq_len
        prefill, chunks = None, []
        if meta.num_seqs > meta.num_decodes and self._prefills_natively(layer):
            chunks = self._chunks(meta)
        elif meta.num_seqs > meta.num_decodes:
            prefill = _plan(meta, kv_cache.shape[2], decode=False)
            if self.invariant:  # the short queries' rows attend as decodes (runs)
                prefill.prefill = [p for p in prefill.prefill if p[1] - p[0] > ROWS_AS_DECODES]
            prefill = prefill if prefill.prefill else None
        return _Step(
            keep=(slots,),
            num_tokens=meta.num_actual_tokens,
            slots=slots.data_ptr(),
            runs=runs,
            threads=self.num_threads if work >= PARALLEL_MIN_WORK else 1,
            prefill=prefill,
            chunks=chunks,
        )

    def _prefills_natively(self, layer) -> bool:
        """Whether `cpu_prefill.cpp` takes this model's prefill chunks: built for this CPU,
        a head size it has an instance for (the cache's dtype is one `supports` takes)."""
        return self.prefill_lib is not None and bool(
            self.prefill_lib.prefill_head_size(layer.head_size)
        )

    def _chunks(self, meta: AttentionMetadata) -> list[_Chunk]:
        """The step's prefill chunks (in batch-invariant mode, the queries too long to
        attend as decodes)."""
        starts, chunks = meta.query_start_loc_cpu, []
        for i in range(meta.num_decodes, meta.num_seqs):
            s, e = int(starts[i]), int(starts[i + 1])
            if self.invariant and e - s <= ROWS_AS_DECODES:
                continue
            table = meta.block_table[i].contiguous()
            chunks.append(_Chunk(s, e - s, int(meta.seq_lens_cpu[i]) - (e - s), table))
        return chunks

    def _runs(self, meta: AttentionMetadata) -> list[_Run]:
        """The decode kernel's calls: the step's decodes (views of the metadata's buffers,
        which a CPU graph's replay reads again); in batch-invariant mode also each row of a
        short query, as the decode at its position (contiguous rows share a call)."""
        nd = meta.num_decodes
        decodes = [_Run(0, meta.block_table[:nd].contiguous(), meta.seq_lens[:nd].contiguous())]
        short = [i for i in range(nd, meta.num_seqs)
                 if meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
                 <= ROWS_AS_DECODES] if self.invariant else []  # fmt: skip
        if not short:
            return decodes if nd else []
        rows = [(r, r, int(meta.seq_lens_cpu[r])) for r in range(nd)]  # (row, sequence, keys)
        for i in short:
            s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            rows += [(r, i, int(meta.seq_lens_cpu[i]) - (e - 1 - r)) for r in range(s, e)]
        runs, start = [], 0
        for j in range(1, len(rows) + 1):
            if j == len(rows) or rows[j][0] != rows[j - 1][0] + 1:
                part = rows[start:j]
                index = torch.tensor([i for _, i, _ in part], device=meta.block_table.device)
                lens = torch.tensor([n for _, _, n in part], dtype=torch.int32)
                runs.append(_Run(part[0][0], meta.block_table.index_select(0, index), lens))
                start = j
        return runs


@dataclass
class _Run:
    """Consecutive query rows that attend as decodes: row `first + j` over the keys of
    block-table row j, `seq_lens[j]` of them."""

    first: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class _Chunk:
    """A prefill chunk for `cpu_prefill.cpp`: `rows` query rows from `start`, one
    sequence's tokens after its `context` cached ones (keys through `block_table`)."""

    start: int
    rows: int
    context: int
    block_table: torch.Tensor


@dataclass
class _Step:
    keep: tuple[torch.Tensor, ...]  # owns the memory behind the pointers below
    num_tokens: int
    slots: int
    runs: list[_Run]
    threads: int
    prefill: _StepPlan | None  # chunks through the torch backend's SDPA
    chunks: list[_Chunk]  # chunks through cpu_prefill.cpp
    states: torch.Tensor | None = None  # a CPU graph's split-KV states (see _record)
