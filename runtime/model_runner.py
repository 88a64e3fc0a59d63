"""Runs one scheduled step on the model: fills persistent input buffers, builds the
attention metadata, sets the forward context, and computes logits only for the rows
that sample."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from compilecore.config import EngineConfig
from compilecore.forward_context import set_forward_context
from runtime.attention import AttentionMetadata
from runtime.block_manager import BlockManager
from runtime.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("compilecore")


@dataclass
class StepInputs:
    order: list[ScheduledRequest]  # rows of the batch: decodes first
    num_tokens: int
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # last new token of each sequence that samples
    sampling: list[ScheduledRequest]


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model: nn.Module, attn_backend):
        self.config = engine_config
        self.model = model
        self.attn_backend = attn_backend
        self.device = engine_config.device
        self.block_size = engine_config.cache_config.block_size
        max_tokens = engine_config.scheduler_config.max_num_batched_tokens
        # Persistent buffers: the compiled graph (and CUDA graphs) read them in place.
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        # Attention metadata lives in persistent buffers too: kernels read them on the device
        # (no host sync), and their addresses never change between steps.
        max_seqs = engine_config.scheduler_config.max_num_seqs
        max_blocks = -(-engine_config.model_config.max_model_len // self.block_size)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=self.device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=self.device)
        self.block_table = torch.zeros(
            (max_seqs, max_blocks), dtype=torch.int32, device=self.device
        )
        self.kv_caches: list[torch.Tensor] = []
        cc = engine_config.compilation_config
        graphs = self.device.type == "cuda" and cc.mode != "none"
        self.capture_sizes = sorted(cc.cudagraph_capture_sizes or []) if graphs else []

    @property
    def attention_layers(self) -> dict[str, nn.Module]:
        return self.config.compilation_config.static_forward_context

    def kv_cache_bytes_per_block(self) -> int:
        dtype_size = torch.empty((), dtype=self.config.model_config.dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_size * dtype_size
            for layer in self.attention_layers.values()
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        dtype = self.config.model_config.dtype
        self.kv_caches = []
        for layer in self.attention_layers.values():
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            cache = torch.zeros(shape, dtype=dtype, device=self.device)
            layer.bind(self.attn_backend, cache)
            self.kv_caches.append(cache)

    def prepare(self, out: SchedulerOutput, block_manager: BlockManager) -> StepInputs:
        order = [s for s in out.scheduled if s.num_new_tokens == 1]
        num_decodes = len(order)
        order += [s for s in out.scheduled if s.num_new_tokens != 1]
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens, tables, logits_rows, sampling = [0], [], [], [], []
        for s in order:
            req, begin = s.request, s.request.num_computed_tokens
            end = begin + s.num_new_tokens
            table = block_manager.block_table(req.request_id)
            ids += req.all_token_ids[begin:end]
            positions += range(begin, end)
            slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables.append(table)
            if s.samples:
                logits_rows.append(starts[-1] - 1)
                sampling.append(s)
        n, b = starts[-1], len(order)
        self.input_ids[:n].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.query_start_loc[: b + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        self.seq_lens[:b].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.slot_mapping[:n].copy_(torch.tensor(slots, dtype=torch.int64))
        width = max(len(t) for t in tables)
        table_rows = torch.zeros((b, width), dtype=torch.int32)
        for i, t in enumerate(tables):
            table_rows[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self.block_table[:b, :width].copy_(table_rows)
        meta = AttentionMetadata(
            num_actual_tokens=n,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            slot_mapping=self.slot_mapping[:n],
            block_table=self.block_table[:b],
            max_query_len=max(s.num_new_tokens for s in order),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        indices = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        return StepInputs(order, n, meta, indices, sampling)

    def padded_size(self, num_tokens: int) -> int:
        """CUDA graphs replay at fixed sizes: pad up to the next one (eager above)."""
        for size in self.capture_sizes:
            if size >= num_tokens:
                return size
        return num_tokens

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [len(inputs.sampling), vocab] for the rows that sample."""
        n = inputs.num_tokens
        padded = self.padded_size(n)
        if padded > n:  # padding rows: token 0 at position 0, written nowhere in the cache
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
        with set_forward_context(inputs.attn_metadata, self.config):
            hidden = self.model(self.input_ids[:padded], self.positions[:padded])
        if not inputs.sampling:
            return hidden.new_empty((0, 0))
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (or load from the cache) before serving; returns the seconds spent.
        Attention sees no metadata and writes nothing."""
        if self.config.compilation_config.mode == "none":
            return 0.0
        start = time.perf_counter()
        n = min(16, self.input_ids.shape[0])
        with set_forward_context(None, self.config):
            self.model(self.input_ids[:n], self.positions[:n])
        return time.perf_counter() - start

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture every piece at every capture size, largest first (CUDA only)."""
        if not self.capture_sizes:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for size in sorted(self.capture_sizes, reverse=True):
            meta = self._dummy_decode_metadata(size)
            with set_forward_context(meta, self.config, capturing=True):
                self.model(self.input_ids[:size], self.positions[:size])
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured CUDA graphs for %d sizes in %.1f s, %.0f MiB",
            len(self.capture_sizes),
            time.perf_counter() - start,
            used / 2**20,
        )

    def _dummy_decode_metadata(self, n: int) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            num_actual_tokens=n,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            block_table=torch.zeros((n, 1), dtype=torch.int32, device=dev),
            max_query_len=1,
            max_seq_len=1,
            num_decodes=n,
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=[1] * n,
        )
