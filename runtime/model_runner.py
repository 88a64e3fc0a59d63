"""Runs one scheduled step on the model.

`plan` turns the scheduler's choice into plain lists (token ids, positions, slots, block
tables): what the driver broadcasts to the other ranks. `execute` writes a plan into
persistent buffers, builds the attention metadata, sets the forward context, runs this
rank's pipeline stage (receiving and sending hidden states between stages), and computes
logits only for the rows that sample.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compilecore import cpu_graph
from compilecore.compile_cache import compile_cache_root
from compilecore.config import EngineConfig
from compilecore.counters import compilation_counter
from compilecore.cuda_graph import FullCudaGraph, full_decode_graphs, piecewise_graphs
from compilecore.dump import dump_root, write_cpu_graph
from compilecore.forward_context import set_forward_context
from compilecore.parallel_state import get_pp_group, get_tp_group, world_rank
from compilecore.weight_watch import WeightWatch
from models.layers.logits_processor import LogitsProcessor
from runtime.async_scheduling import Feed
from runtime.attention import AttentionMetadata
from runtime.block_manager import BlockManager
from runtime.lm_head import choose_lm_head_kernels
from runtime.sampler import SAMPLE_GREEDY, SAMPLE_OFF, SAMPLE_PARAMS
from runtime.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("compilecore")
# Captures of one size that met a module compiled mid-capture before it gives up.
MAX_CAPTURE_TRIES = 3
# Decode batches up to this size record CPU graphs by default, each its own (padding would cost
# compute: at 9-16 rows the products are compute-bound). docs/kernel-choices.md, CPU graph
# sizes.
CPU_GRAPH_MAX_BATCH = 16
# Larger decode batches record graphs at these sizes, a batch padded up to the next one where
# that adds at most 1/8 of its rows (64 x (128 + 128) on the Q8_0 file ran 1.09x faster end to
# end with a graph at 64 than piece by piece, benchmarks/ab_cpu_graph_sizes.py,
# docs/kernel-choices.md; padding costs compute at these sizes).
CPU_GRAPH_LARGE_SIZES = (24, 32, 40, 48, 56, 64)
CPU_GRAPH_MAX_PAD = 1 / 8


@dataclass
class StepPlan:
    """One step as plain data (sent to every rank). Rows that decode come first."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_starts: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    num_decodes: int = 0
    logits_rows: list[int] = field(default_factory=list)  # last token of each sampling row
    # The logits only feed an argmax (every row greedy without logprobs or processing):
    # the batch-1 LM head may compute only the rows that can win (passes/ops/gemv.py).
    argmax_only: bool = False
    # Each sampling row's `Request.sample_row` where every request samples plainly (no
    # logprobs, no logits processing) and some not greedily: a full CUDA graph draws them.
    sample_rows: list[tuple[tuple[float, float, float], tuple[int, int, int]]] = field(
        default_factory=list
    )
    # Token indices whose ids are still on the device (async scheduling), each with its
    # request id: the runner gathers them from the previous step's tokens (`Feed`).
    fed: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]


@dataclass
class PromptLogprobRows:
    """Logits rows [start, start + count) of a step: the request's prompt positions
    `first`.. (each row predicts the prompt token after it)."""

    request: Any
    start: int
    count: int
    first: int


@dataclass
class DraftRows:
    """Logits rows [start, start + len(drafts) + 1) of a step: a request's last token and
    its drafts, each row the distribution of the token after it (runtime/spec_decode.py)."""

    request: Any
    start: int
    drafts: list[int]


def plan_step(
    out: SchedulerOutput, block_manager: BlockManager, device_draws: bool = True
) -> tuple[StepPlan, list[ScheduledRequest], list[PromptLogprobRows], list[DraftRows]]:
    """The step's plan, the scheduled requests whose rows sample (the first logits rows,
    in order), the rows after them that prompt logprobs need, then the rows that verify
    drafts. `device_draws`: a CUDA graph may draw the tokens (`StepPlan.sample_rows`);
    False on CPU, where no step reads them."""
    order = [s for s in out.scheduled if s.num_new_tokens == 1]
    plan = StepPlan(num_decodes=len(order))
    order += [s for s in out.scheduled if s.num_new_tokens != 1]
    bs = block_manager.block_size
    sampling, prompt_rows, draft_rows = [], [], []
    for s in order:
        req, begin = s.request, s.request.num_computed_tokens
        end = begin + s.num_new_tokens
        table = block_manager.block_table(req.request_id)
        known = req.all_token_ids[begin : end - len(s.drafts)] + s.drafts
        if end - begin - len(known) > 1:
            raise RuntimeError(f"{req.request_id}: more than one token pending at a step")
        if len(known) < end - begin:  # the last one is pending: 0 until the runner's gather
            plan.fed.append((len(plan.token_ids) + len(known), req.request_id))
            known = known + [0]
        plan.token_ids += known
        plan.positions += range(begin, end)
        plan.slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
        plan.query_starts.append(plan.query_starts[-1] + s.num_new_tokens)
        plan.seq_lens.append(end)
        plan.block_tables.append(list(table))
        if s.drafts:
            draft_rows.append(DraftRows(req, plan.query_starts[-2], s.drafts))
        elif s.samples:
            plan.logits_rows.append(plan.query_starts[-1] - 1)
            sampling.append(s)
        if req.sampling_params.prompt_logprobs is not None and begin < req.num_prompt_tokens - 1:
            last = min(end, req.num_prompt_tokens - 1)  # the last prompt row predicts output
            prompt_rows.append(PromptLogprobRows(req, 0, last - begin, begin))
    verifying = [rows.request for rows in draft_rows]
    plan.argmax_only = (
        bool(sampling or draft_rows)
        and not prompt_rows
        and all(r.plain_greedy for r in [*(s.request for s in sampling), *verifying])
    )
    direct = device_draws and sampling and not (plan.argmax_only or prompt_rows or draft_rows)
    if direct and all(s.request.plain for s in sampling):
        plan.sample_rows = [s.request.sample_row() for s in sampling]
    start = len(plan.logits_rows)
    for rows in prompt_rows:
        first_row = plan.query_starts[order.index(_scheduled_of(order, rows.request))]
        rows.start = start
        plan.logits_rows += range(first_row, first_row + rows.count)
        start += rows.count
    for rows in draft_rows:
        first_row, rows.start = rows.start, len(plan.logits_rows)
        plan.logits_rows += range(first_row, first_row + len(rows.drafts) + 1)
    return plan, sampling, prompt_rows, draft_rows


def _scheduled_of(order: list[ScheduledRequest], request: Any) -> ScheduledRequest:
    return next(s for s in order if s.request is request)


# A padding row's sampling: the argmax, the kernel's cheapest (its token is dropped).
_GREEDY_ROW = ((0.0, 1.0, 0.0), (0, 0, 0))


def pad_decode_plan(plan: StepPlan, size: int) -> StepPlan:
    """A decode-only plan grown to `size` sequences. Each padding sequence decodes token 0
    at position 0 against one token of block 0, writes its K/V nowhere (slot -1), and its
    logits row is dropped: the shapes of a captured graph, no effect on real requests."""
    extra = size - plan.num_tokens
    if extra == 0:
        return plan
    last = plan.query_starts[-1]
    return StepPlan(
        token_ids=plan.token_ids + [0] * extra,
        positions=plan.positions + [0] * extra,
        slots=plan.slots + [-1] * extra,
        query_starts=plan.query_starts + list(range(last + 1, last + extra + 1)),
        seq_lens=plan.seq_lens + [1] * extra,
        block_tables=plan.block_tables + [[0]] * extra,
        num_decodes=size,
        logits_rows=list(range(size)),
        argmax_only=plan.argmax_only,
        sample_rows=plan.sample_rows and plan.sample_rows + [_GREEDY_ROW] * extra,
    )


def rows_as_decodes(plan: StepPlan) -> StepPlan | None:
    """A step whose every token is a logits row (decodes beside speculative verifications,
    each a query of 1 + k tokens) as a decode-only plan: each token a sequence of its own
    whose keys end at its position (its query's earlier tokens' K/V are written in the
    same step, before any attention reads them, as every step's are), so that the step
    replays the decode graph of its token count. None for any other step."""
    n = plan.num_tokens
    if plan.num_decodes == n or plan.logits_rows != list(range(n)):
        return None
    starts = plan.query_starts
    owner = [i for i in range(len(plan.seq_lens)) for _ in range(starts[i + 1] - starts[i])]
    return StepPlan(
        token_ids=plan.token_ids,
        positions=plan.positions,
        slots=plan.slots,
        query_starts=list(range(n + 1)),
        seq_lens=[p + 1 for p in plan.positions],
        block_tables=[plan.block_tables[i] for i in owner],
        num_decodes=n,
        logits_rows=plan.logits_rows,
        argmax_only=plan.argmax_only,
        sample_rows=plan.sample_rows,
        fed=plan.fed,
    )


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model: nn.Module, attn_backend):
        self.config = engine_config
        self.model = model
        self.attn_backend = attn_backend
        choose_lm_head_kernels(model, engine_config)  # the runtime's choice (runtime/lm_head.py)
        self.device = engine_config.device
        self.dtype = engine_config.model_config.dtype
        self.block_size = engine_config.cache_config.block_size
        max_tokens = engine_config.scheduler_config.max_num_batched_tokens
        max_seqs = engine_config.scheduler_config.max_num_seqs
        max_blocks = -(-engine_config.model_config.max_model_len // self.block_size)
        # Persistent buffers: the compiled pieces (and CUDA graphs) read inputs in place, and
        # attention kernels read metadata on the device (no host sync, fixed addresses).
        dev, i32 = self.device, torch.int32
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=i32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=i32, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros((max_seqs, max_blocks), dtype=i32, device=dev)
        # The rows whose logits are computed (vLLM's logits_indices): staged like the rest,
        # so a GPU step gathers them without a pageable, synchronizing copy.
        self.logits_indices = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        # Async scheduling's gather of pending ids (`Feed`): destination token indices,
        # source rows of the previous step's tokens.
        self.feed_dst = torch.zeros(max_seqs, dtype=torch.long, device=dev)
        self.feed_src = torch.zeros(max_seqs, dtype=torch.long, device=dev)
        # The sampling rows' parameters a full CUDA graph's draw reads (`StepPlan.sample_rows`).
        self.sample_floats = torch.zeros(max_seqs, 3, dtype=torch.float32, device=dev)
        self.sample_ints = torch.zeros(max_seqs, 3, dtype=torch.long, device=dev)
        self._feed: Feed | None = None  # this step's, set by `execute`
        self.kv_caches: list[torch.Tensor] = []
        self._warmed_attention: set[tuple[int, ...]] = set()  # layer shapes (warm_up)
        # numpy views of the same memory: filling them costs ~1 us, a torch.tensor + copy_
        # ~10 us, and a decode step fills six.
        # On a GPU the same views are of pinned host buffers, copied with non_blocking=True:
        # the host does not wait for the copies (pageable memory would make it).
        names = ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping",
                 "block_table", "logits_indices", "feed_dst", "feed_src", "sample_floats",
                 "sample_ints")  # fmt: skip
        if self.device.type == "cpu":
            self.staging = None
            self.host_views = {name: getattr(self, name).numpy() for name in names}
        else:
            pinned = torch.cuda.is_available()
            host = {name: torch.zeros_like(getattr(self, name), device="cpu") for name in names}
            self.staging = {n: t.pin_memory() if pinned else t for n, t in host.items()}
            self.host_views = {name: t.numpy() for name, t in self.staging.items()}
        # Recorded after each step's staging copies and waited on before the staging
        # buffers are written again: a step that does not sample (a prompt chunk, a rank
        # that is not the driver) returns without a sync, and a GPU still behind would
        # otherwise copy the next step's token ids, positions and slots.
        self._staged = torch.cuda.Event() if self.staging is not None else None
        cc = engine_config.compilation_config
        graphs = self.device.type == "cuda" and cc.mode != "none"
        sizes = sorted(cc.cudagraph_capture_sizes or []) if graphs else []
        # The pieces pad to their capture sizes; decode-only steps to the full graphs'.
        self.capture_sizes = sizes if piecewise_graphs(cc.cudagraph_mode) else []
        # A decode-only step has a token a sequence: no full graph beyond max_num_seqs
        # (its metadata buffers hold max_num_seqs sequences).
        full = self._full_graphs_possible(attn_backend)
        self.full_graph_sizes = [s for s in sizes if s <= max_seqs] if full else []
        self.full_graphs: dict[int, FullCudaGraph] = {}
        # The full graphs draw the step's tokens too (runtime/sample_kernel.py) as this flag
        # says (`SAMPLE_*`: greedy, or by each row's parameters, where every request samples
        # plainly); `graph_tokens` holds them after such a step, None after any other.
        self.sample_flag = torch.zeros(1, dtype=torch.int32, device=dev) if full else None
        self._sample_mode = SAMPLE_OFF  # what the device flag holds (set only on a change)
        self.graph_tokens: torch.Tensor | None = None
        # CPU graphs: decode-only steps at a size with static code, one process, compiled.
        cpu_graphs = (
            self.device.type == "cpu"
            and cc.mode != "none"
            and cc.cpu_graphs
            and engine_config.parallel_config.world_size == 1
        )
        sizes = cc.cpu_graph_sizes
        if sizes is None:  # decode batches record from the symbolic-size code too
            sizes = [*(cc.compile_sizes or []), *range(1, CPU_GRAPH_MAX_BATCH + 1),
                     *CPU_GRAPH_LARGE_SIZES]  # fmt: skip
        self.cpu_graph_sizes = set(sizes) if cpu_graphs else set()
        self.cpu_graph_order = sorted(self.cpu_graph_sizes)
        # Sizes the user lists are padded to whatever the batch (vLLM's capture sizes).
        self.cpu_graph_max_pad = CPU_GRAPH_MAX_PAD if cc.cpu_graph_sizes is None else None
        self.cpu_graphs: dict[int, cpu_graph.CpuGraph | None] = {}  # None: not capturable
        # Graph sizes whose first replay on new token ids is still to be checked against
        # the same step run piece by piece (`_check_first_replay`): the capture's ids.
        self._unchecked: dict[int, torch.Tensor] = {}
        self._capture_tries: dict[int, int] = {}
        self._pp_buffers: Any = None  # a later pipeline stage's receive buffers
        for layer in self.attention_layers.values():  # compiling runs attention before the cache
            layer.bind(attn_backend)
        # Graphs hold raw weight addresses, and some ops read copies made from weights:
        # any weight replaced or written makes them stale (compilecore/weight_watch.py).
        self.weight_watch = WeightWatch(model)
        # The model's own argmax-only flags (the batch-1 LM head may then compute only the
        # rows that can win): set for each step, cleared after it.
        self._argmax_setters = [
            m.set_argmax_only for m in model.modules() if isinstance(m, LogitsProcessor)
        ]

    def _full_graphs_possible(self, attn_backend: Any) -> bool:
        cc = self.config.compilation_config
        if (
            self.device.type != "cuda"
            or cc.mode == "none"
            or not full_decode_graphs(cc.cudagraph_mode)
        ):
            return False
        why = None
        if self.config.parallel_config.world_size > 1:
            why = "more than one process (the collectives are not captured yet)"
        elif not getattr(attn_backend, "supports_full_cudagraph", False):
            why = f"the {getattr(attn_backend, 'name', attn_backend)} attention backend"
        if why:
            logger.info("cudagraph_mode %s: no full decode graphs with %s; piecewise only",
                        cc.cudagraph_mode, why)  # fmt: skip
        return why is None

    @property
    def attention_layers(self) -> dict[str, nn.Module]:
        return self.config.compilation_config.static_forward_context

    def kv_cache_bytes_per_block(self) -> int:
        dtype_size = torch.empty((), dtype=self.dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_size * dtype_size
            for layer in self.attention_layers.values()
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        warm_up = getattr(self.attn_backend, "warm_up", None)  # kernels compiled per shape
        for layer in self.attention_layers.values():
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            cache = _zeros_untouched(shape, self.dtype, self.device)
            layer.bind(self.attn_backend, cache)
            self.kv_caches.append(cache)
            key = (layer.num_heads, *shape[2:])
            if warm_up is not None and key not in self._warmed_attention:
                warm_up(layer, cache)
                self._warmed_attention.add(key)

    def padded_size(self, num_tokens: int) -> int:
        """CUDA graphs replay at fixed sizes: pad up to the next one (eager above)."""
        for size in self.capture_sizes:
            if size >= num_tokens:
                return size
        return num_tokens

    def _load(self, plan: StepPlan) -> tuple[int, AttentionMetadata]:
        padded, n, b = self._write_inputs(plan), plan.num_tokens, len(plan.seq_lens)
        meta = AttentionMetadata(
            num_actual_tokens=n,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            slot_mapping=self.slot_mapping[:n],
            block_table=self.block_table[:b],
            max_query_len=max(e - s for s, e in zip(plan.query_starts, plan.query_starts[1:])),
            max_seq_len=max(plan.seq_lens),
            num_decodes=plan.num_decodes,
            query_start_loc_cpu=plan.query_starts,
            seq_lens_cpu=plan.seq_lens,
        )
        return padded, meta

    def _write_inputs(self, plan: StepPlan, logits_rows: bool = True) -> int:
        """The step's token ids, positions and attention inputs into the persistent
        buffers (what a recorded graph reads), and the rows whose logits are gathered
        unless `logits_rows` is False (a CPU graph's head takes rows 0..n-1 as they are);
        returns the padded token count."""
        n, b = plan.num_tokens, len(plan.seq_lens)
        padded = self.padded_size(n)
        # Padding rows: token 0 at position 0, slot -1 (written nowhere in the cache).
        pad = [0] * (padded - n)
        if self._staged is not None:
            self._staged.synchronize()  # the last step's copies have read the staging
        views = self.host_views  # the buffers themselves on CPU, pinned staging on a GPU
        views["input_ids"][:padded] = plan.token_ids + pad
        views["positions"][:padded] = plan.positions + pad
        views["query_start_loc"][: b + 1] = plan.query_starts
        views["seq_lens"][:b] = plan.seq_lens
        views["slot_mapping"][:n] = plan.slots
        for i, t in enumerate(plan.block_tables):
            views["block_table"][i, : len(t)] = t
        r = len(plan.logits_rows) if logits_rows else 0
        if r:
            views["logits_indices"][:r] = plan.logits_rows
        f = len(self._feed.dst) if self._feed is not None else 0
        if f:
            views["feed_dst"][:f], views["feed_src"][:f] = self._feed.dst, self._feed.src
        s = len(plan.sample_rows) if self.sample_flag is not None else 0
        if s:
            floats, ints = zip(*plan.sample_rows)
            views["sample_floats"][:s], views["sample_ints"][:s] = floats, ints
        if self.staging is not None:
            rows = {"input_ids": padded, "positions": padded, "query_start_loc": b + 1,
                    "seq_lens": b, "slot_mapping": n, "block_table": b,
                    "logits_indices": r, "feed_dst": f, "feed_src": f,
                    "sample_floats": s, "sample_ints": s}  # fmt: skip
            for name, k in rows.items():
                getattr(self, name)[:k].copy_(self.staging[name][:k], non_blocking=True)
            self._staged.record()
        if f:  # after the ids' copy, in stream order: no host sync on the previous step
            ids = self._feed.source.index_select(0, self.feed_src[:f])
            self.input_ids.index_copy_(0, self.feed_dst[:f], ids)
        return padded

    def execute(self, plan: StepPlan, feed: Feed | None = None) -> torch.Tensor | None:
        """Run this rank's stage. Returns logits [len(plan.logits_rows), vocab] on global
        rank 0 (the driver), None elsewhere. `feed`: the plan's input ids that are still
        on the device (async scheduling)."""
        if self.weight_watch.check():  # a weight moved: record again
            self.cpu_graphs.clear()
            if self.full_graphs:
                self.capture_full_graphs()
        as_decodes = rows_as_decodes(plan) if self.cpu_graph_sizes else None
        if as_decodes is not None and self._cpu_graph_size(as_decodes) is not None:
            plan = as_decodes  # verifications replay the decode graph of their token count
        size, graph = self._whole_step_graph(plan)
        # Only for this step: whoever computes logits next (a test, a tool) gets them all.
        self._set_argmax_only(plan.argmax_only)
        self._feed = feed
        self.graph_tokens = None
        try:
            if isinstance(graph, FullCudaGraph):
                self._write_inputs(pad_decode_plan(plan, size), logits_rows=False)
                mode = SAMPLE_GREEDY if plan.argmax_only else SAMPLE_OFF
                if plan.sample_rows:
                    mode = SAMPLE_PARAMS
                if mode != self._sample_mode:  # no fill kernel a step
                    self.sample_flag.fill_(mode)
                    self._sample_mode = mode
                logits, tokens = graph.replay()
                if mode != SAMPLE_OFF:
                    self.graph_tokens = tokens[: plan.num_tokens]
                return logits if size == plan.num_tokens else logits[: plan.num_tokens]
            if graph is not None:
                # A recorded step calls no torch function on the way, not even inference mode's
                # guard: right after the weights have streamed through the caches each such call
                # costs tens of microseconds (docs/kernel-choices.md, Host time).
                self._write_inputs(pad_decode_plan(plan, size), logits_rows=False)
                compilation_counter.num_cpu_graph_replays += 1
                logits = graph.replay()
                if size in self._unchecked:
                    logits = self._check_first_replay(plan, size, logits)
                return logits if size == plan.num_tokens else logits[: plan.num_tokens]
            return self._execute(plan, size if self.device.type == "cpu" else None)
        finally:
            self._set_argmax_only(False)
            self._feed = None

    def _set_argmax_only(self, flag: bool) -> None:
        for set_flag in self._argmax_setters:
            set_flag(flag)

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, cpu_graph_size: int | None) -> torch.Tensor | None:
        n, size = plan.num_tokens, cpu_graph_size
        if size is not None and size not in self.cpu_graphs:  # the first step of its size
            _, meta = self._load(pad_decode_plan(plan, size))
            return self._capture_cpu_graph(size, meta)[:n]  # padding sequences' rows dropped
        padded, meta = self._load(plan)
        pp = get_pp_group()
        inputs = None
        if not pp.is_first_rank:  # hidden states and residual from the stage before
            inputs = self._intermediate_inputs(padded)
            pp.recv_tensors(inputs.tensors, src=pp.rank_in_group - 1)
        with set_forward_context(meta, self.config):
            out = self.model(self.input_ids[:padded], self.positions[:padded], inputs)
        if not pp.is_last_rank:
            pp.send_tensors(out.tensors, dst=pp.rank_in_group + 1)
            return self._logits_from_last_stage(plan) if world_rank() == 0 else None
        if not plan.logits_rows:
            return None
        logits = self.model.compute_logits(out[self.logits_indices[: len(plan.logits_rows)]])
        if world_rank() != 0 and get_tp_group().is_first_rank and pp.world_size > 1:
            pp.send_tensors({"logits": logits}, dst=0)
        return logits if world_rank() == 0 else None

    def _intermediate_inputs(self, n: int) -> Any:
        """The previous stage's hidden states and residual land in persistent buffers
        (views of one allocation at the token budget): a CUDA graph of the first piece
        reads them at the addresses it was captured with."""
        if self._pp_buffers is None:
            most = self.config.scheduler_config.max_num_batched_tokens
            self._pp_buffers = self.model.make_empty_intermediate_tensors(
                most, self.dtype, self.device
            )
        full = self._pp_buffers
        return type(full)({k: v[:n] for k, v in full.tensors.items()})

    def _whole_step_graph(self, plan: StepPlan) -> tuple[int | None, Any]:
        """The decode-only step's graph size and graph (a full CUDA graph or a CPU
        graph; None before a CPU graph's first step and where there is none)."""
        if self.full_graph_sizes:
            n = plan.num_tokens
            if plan.num_decodes != n or len(plan.logits_rows) != n:
                return None, None
            size = next((s for s in self.full_graph_sizes if s >= n), None)
            return size, self.full_graphs.get(size)
        size = self._cpu_graph_size(plan)
        return size, self.cpu_graphs.get(size) if size is not None else None

    def _cpu_graph_size(self, plan: StepPlan) -> int | None:
        """The CPU-graph size for a decode-only step: its batch, padded up to the next
        graph size (like CUDA graphs; with the default sizes, where that adds at most
        `CPU_GRAPH_MAX_PAD` of its rows); None for any other step."""
        n = plan.num_tokens
        if not self.cpu_graph_sizes or plan.num_decodes != n or len(plan.logits_rows) != n:
            return None
        size = next((s for s in self.cpu_graph_order if s >= n), None)
        limit = self.cpu_graph_max_pad
        if size is None or (limit is not None and size - n > limit * n):
            return None
        return size

    def _capture_cpu_graph(self, n: int, meta: AttentionMetadata) -> torch.Tensor:
        """Run this decode step while recording it; check that a replay of the recording
        gives the same logits, then keep it for every later step of this size."""

        def step() -> torch.Tensor:
            with set_forward_context(meta, self.config):
                out = self.model(self.input_ids[:n], self.positions[:n], None)
            return self.model.compute_logits(out[:n])  # rows 0..n-1: a view, not a gather

        try:
            logits, graph = cpu_graph.capture(step, compile_cache_root(self.config))
        except cpu_graph.CpuGraphUnsupported as exc:
            tries = self._capture_tries[n] = self._capture_tries.get(n, 0) + 1
            if exc.alarming:
                logger.warning("no CPU graph for %d tokens (%s): running piece by piece", n, exc)
                self.cpu_graphs[n] = None
            elif exc.transient and tries < MAX_CAPTURE_TRIES:
                logger.info("no CPU graph for %d tokens yet (%s): next step tries again", n, exc)
            else:
                logger.info("no CPU graph for %d tokens (%s): running piece by piece", n, exc)
                self.cpu_graphs[n] = None
            with set_forward_context(meta, self.config):
                out = self.model(self.input_ids[:n], self.positions[:n], None)
            return self.model.compute_logits(out[:n])
        expected = logits.clone()
        if not torch.equal(graph.replay(), expected):  # the replay rewrites the same KV
            logger.warning("CPU graph for %d tokens differs from its capture: not used", n)
            self.cpu_graphs[n] = None
            return expected
        logger.info("captured a CPU graph for %d tokens: %r", n, graph)
        if (root := dump_root(self.config)) is not None:
            write_cpu_graph(root, n, graph)
        self.cpu_graphs[n] = graph
        self._unchecked[n] = self.input_ids[:n].clone()
        return logits

    def _check_first_replay(self, plan: StepPlan, n: int, logits: torch.Tensor) -> torch.Tensor:
        """A graph's first replay against the same step run piece by piece (which then
        rewrites the step's KV): fail closed. The capture's own replay check reads the
        buffers the capture just filled, so a kernel that ran but was not recorded (the
        hook of compilecore/wrapper_codegen.py bypassed, as another torch release might)
        passed it; with new inputs its buffer's stale values show. New token ids, not just
        new positions: a greedy step that repeats the capture's token found the embedding
        kernel's stale output right (tests/test_cpu_graph.py), so steps on the capture's ids
        are checked too and the check waits for other ids."""
        replayed = logits.clone()
        new_ids = not torch.equal(self.input_ids[:n], self._unchecked[n])
        want = self._execute(pad_decode_plan(plan, n), None)
        same = torch.equal(replayed, want)
        if new_ids or not same:
            del self._unchecked[n]
        if not same:
            logger.warning(
                "CPU graph for %d tokens: its first replay differs from the step run piece "
                "by piece (a kernel that torch %s ran outside the recorded calls?); not used",
                n, torch.__version__,
            )  # fmt: skip
            self.cpu_graphs[n] = None
        return want

    def _logits_from_last_stage(self, plan: StepPlan) -> torch.Tensor | None:
        if not plan.logits_rows:
            return None
        vocab = self.config.model_config.hf_config.vocab_size
        logits = {
            "logits": torch.empty(
                len(plan.logits_rows), vocab, dtype=self.dtype, device=self.device
            )
        }
        pp = get_pp_group()
        pp.recv_tensors(logits, src=pp.world_size - 1)
        return logits["logits"]

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (or load from the cache) before serving; returns the seconds spent.
        Attention sees no metadata and writes nothing; each pipeline stage compiles on
        zeros of its own, without talking to the others."""
        if self.config.compilation_config.mode == "none":
            return 0.0
        start = time.perf_counter()
        out = self._dummy_forward(min(16, self.input_ids.shape[0]))
        if get_pp_group().is_last_rank:
            # The one-row LM head is its own compiled function: compiled here with the
            # rest, so no step pays for it (a capture it fell into would be retried).
            logits = self.model.compute_logits(out[:1])
            if self.device.type == "cuda":
                self._warm_sampler(logits)
        return time.perf_counter() - start

    def _warm_sampler(self, logits: torch.Tensor) -> None:
        """Compile the sampling kernel for the host sampler's fp32 logits (`Sampler._draw`
        after a step with no full graph), not at the first such step; the full graphs
        compile theirs when captured."""
        from runtime.sample_kernel import sample_tokens  # imports Triton

        flag = torch.full((1,), SAMPLE_PARAMS, dtype=torch.int32, device=self.device)
        floats = torch.zeros(1, 3, dtype=torch.float32, device=self.device)
        ints = torch.zeros(1, 3, dtype=torch.long, device=self.device)
        sample_tokens(logits.float(), flag, floats, ints)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Peak activation bytes of one forward over the whole token budget plus the
        logits of the most sequences a step samples (CUDA; 0 elsewhere). The KV cache is
        sized after it, so the first full prefill cannot run out of memory."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        out = self._dummy_forward(self.input_ids.shape[0])
        if get_pp_group().is_last_rank:
            rows = self.config.scheduler_config.max_num_seqs
            self.model.compute_logits(out[:rows])
        del out
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def _dummy_forward(self, n: int) -> Any:
        inputs = None
        if not get_pp_group().is_first_rank:
            inputs = self.model.make_empty_intermediate_tensors(n, self.dtype, self.device)
        with set_forward_context(None, self.config):
            return self.model(self.input_ids[:n], self.positions[:n], inputs)

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture every piece at every capture size, largest first (CUDA only)."""
        if not self.capture_sizes:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for size in sorted(self.capture_sizes, reverse=True):
            meta = self._dummy_metadata(size)
            # A later stage's first piece reads the persistent receive buffers, at the
            # addresses its steps will pass (fresh tensors here failed the replay's check).
            inputs = None if get_pp_group().is_first_rank else self._intermediate_inputs(size)
            with set_forward_context(meta, self.config, capturing=True):
                self.model(self.input_ids[:size], self.positions[:size], inputs)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured CUDA graphs for %d sizes in %.1f s, %.0f MiB",
            len(self.capture_sizes),
            time.perf_counter() - start,
            used / 2**20,
        )

    @torch.inference_mode()
    def capture_full_graphs(self, largest_only: bool = False) -> None:
        """Capture each decode-only step size whole, largest first (CUDA, after the KV
        cache exists: the graphs hold its address). Padding sequences decode at position
        0 and write nowhere; attention sizes its KV splits for the longest context.
        `largest_only`: a stand-in capture of the largest size before the KV cache is
        sized (over the placeholder cache), so that what the graphs hold (activations,
        logits, split-KV partials) is in the engine's own use; kept until the real
        captures, which reuse its memory in the shared pool, are done."""
        if not self.full_graph_sizes:
            return
        from runtime.sample_kernel import sample_tokens  # imports Triton

        start = time.perf_counter()
        stand_in = list(self.full_graphs.values())  # alive until the captures below end
        self.full_graphs.clear()
        sizes = sorted(self.full_graph_sizes, reverse=True)
        for size in sizes[:1] if largest_only else sizes:
            _, meta = self._load(pad_decode_plan(StepPlan(), size))
            meta.max_seq_len = self.config.model_config.max_model_len

            def step(size: int = size, meta: AttentionMetadata = meta):
                with set_forward_context(meta, self.config, full_graph=True):
                    out = self.model(self.input_ids[:size], self.positions[:size], None)
                    logits = self.model.compute_logits(out[:size])
                    flag, floats, ints = self.sample_flag, self.sample_floats, self.sample_ints
                    return logits, sample_tokens(logits, flag, floats[:size], ints[:size])

            self.full_graphs[size] = FullCudaGraph(step, self.config)
        torch.cuda.synchronize(self.device)
        del stand_in
        logger.info("captured full decode graphs for %d sizes in %.1f s",
                    len(self.full_graphs), time.perf_counter() - start)  # fmt: skip

    def _dummy_metadata(self, n: int) -> AttentionMetadata:
        """One sequence of n new tokens over block 0, writing nowhere: shapes for capture."""
        self.query_start_loc[:2].copy_(torch.tensor([0, n], dtype=torch.int32))
        self.seq_lens[:1].fill_(n)
        self.slot_mapping[:n].fill_(-1)
        self.block_table[:1].zero_()
        return AttentionMetadata(
            num_actual_tokens=n,
            query_start_loc=self.query_start_loc[:2],
            seq_lens=self.seq_lens[:1],
            slot_mapping=self.slot_mapping[:n],
            block_table=self.block_table[:1],
            max_query_len=n,
            max_seq_len=n,
            num_decodes=1 if n == 1 else 0,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[n],
        )


def _zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """Zeros that take memory only where used: on CPU an anonymous mapping, which the
    kernel backs page by page on first touch. `torch.zeros` writes every page at once, so
    each CPU engine held its whole KV budget (1 GiB by default) from the start, however few
    blocks it used (a test process with a dozen engines reached 15 GB)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
