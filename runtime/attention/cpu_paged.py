"""The CPU attention backend: KV writes and decode attention in C++ (`cpu_kernels.cpp`),
prefill chunks through the torch backend's SDPA path.

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
from runtime.attention.cpu_build import load_cpu_kernels
from runtime.attention.metadata import AttentionMetadata
from runtime.attention.torch_paged import TorchPagedAttentionBackend, _plan, _StepPlan

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Below this many (sequence, KV head, token) triples, one thread beats waking the pool.
# Batch-1 decode of SmolLM2 (3 KV heads) goes parallel from 64 tokens on: the kernel then
# splits the sequence so both threads work (benchmarks/NOTES.md, section 32). Eager steps
# only: a CPU graph replays decode in a team already awake (section 38).
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
    scale: torch.Tensor  # the softmax scale as a tensor, for team_decode
    k_cache: int
    v_cache: int
    row: int  # elements per cache slot
    shape: tuple[int, int, int, int, float]  # heads, KV heads, head size, block size, scale


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    name = "cpu"

    def __init__(self, num_threads: int | None = None, cache_dir: Path | None = None):
        self.lib = load_cpu_kernels(cache_dir)
        self.num_threads = num_threads or torch.get_num_threads()
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
        if step.num_decodes:
            q = _rows(q)
            bound.decode(q.data_ptr(), q.stride(0), bound.k_cache, bound.v_cache,
                         step.block_table, step.block_table_stride, step.seq_lens,
                         output.data_ptr(), output.stride(0), step.num_decodes, *bound.shape,
                         step.threads)  # fmt: skip
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
        if step.prefill is not None:
            raise native_calls.Unrecordable("CPU attention: prefill chunks run in Python")
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
        if step.num_decodes:
            # Split-KV parts' softmax states, until their merge: the layers run one after
            # another, so the step's layers share one buffer.
            size = self.lib.decode_team_states(step.num_decodes, *bound.shape[:3])
            if step.states is None or step.states.numel() < size:
                step.states = torch.empty(size)
            calls.append(NativeCall(
                address(bound.team_decode),
                (q, q.stride(0), bound.k_cache, bound.v_cache, step.keep[1],
                 step.block_table_stride, step.keep[2], output, output.stride(0),
                 step.num_decodes, *bound.shape[:4], bound.scale, step.states),
                "CPU attention (decode)", team, None,
            ))  # fmt: skip
        return tuple(calls)

    def _step(self, meta: AttentionMetadata, layer, kv_cache: torch.Tensor) -> _Step:
        """What every layer of a step passes the kernels (worked out on the first layer)."""
        nd = meta.num_decodes
        slots = meta.slot_mapping[: meta.num_actual_tokens].contiguous()
        block_table = meta.block_table[:nd].contiguous()
        seq_lens = meta.seq_lens[:nd].contiguous()
        work = nd * layer.num_kv_heads * meta.max_seq_len
        has_prefill = meta.num_seqs > nd
        return _Step(
            keep=(slots, block_table, seq_lens),
            num_tokens=meta.num_actual_tokens,
            slots=slots.data_ptr(),
            num_decodes=nd,
            block_table=block_table.data_ptr(),
            block_table_stride=block_table.stride(0),
            seq_lens=seq_lens.data_ptr(),
            threads=self.num_threads if work >= PARALLEL_MIN_WORK else 1,
            prefill=_plan(meta, kv_cache.shape[2], decode=False) if has_prefill else None,
        )


@dataclass
class _Step:
    keep: tuple[torch.Tensor, ...]  # owns the memory behind the pointers below
    num_tokens: int
    slots: int
    num_decodes: int
    block_table: int
    block_table_stride: int
    seq_lens: int
    threads: int
    prefill: _StepPlan | None
    states: torch.Tensor | None = None  # a CPU graph's split-KV states (see _record)
