"""Continuous batching under a token budget.

Each step: running requests first (decodes, and prompts still being prefilled in chunks),
then waiting requests in arrival order, as long as the token budget
(`max_num_batched_tokens`), the sequence cap (`max_num_seqs`) and free KV blocks allow.
A long prompt is prefilled in chunks across steps. When blocks run out, the most recently
admitted running request is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed (prefix caching usually makes that cheap).

Batch-invariant mode: a request's chunks are cut where a run alone cuts them, and a step
holds either short queries only (at most ROWS_AS_DECODES tokens each and in all: decodes,
verifications, short prompts) or long chunks only, the kinds taking turns. The products
take one path per kind (exact row products for short steps, strips for long ones:
`passes/ops/quant/formats.h` INVARIANT_ROWS), so a row's path never depends on the batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from compilecore.config import CacheConfig, SchedulerConfig
from runtime.attention.torch_paged import ROWS_AS_DECODES
from runtime.block_manager import BlockManager
from runtime.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the drafts included
    # Proposed tokens computed after its last one, to verify (runtime/spec_decode.py).
    drafts: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens (so one is sampled)."""
        r = self.request
        new = self.num_new_tokens - len(self.drafts)
        return r.num_computed_tokens + new == r.num_scheduled_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int | None = None,
    ):
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._long_step = False  # batch-invariant mode: this step's kind (long chunks)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.invariant_chunk is not None:
            self._long_step = self._next_step_is_long()
            budget = budget if self._long_step else min(budget, ROWS_AS_DECODES)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if self.config.invariant_chunk is not None and not self._long_step:
            # More short queries than a step holds: the ones served go to the back.
            served = {id(s.request) for s in out.scheduled}
            self.running.sort(key=lambda r: id(r) in served)
        return out

    def _next_step_is_long(self) -> bool:
        """Batch-invariant mode: the next step's kind, the other one when both have work."""
        kinds = set()
        for req in self.running:
            if self.max_model_len is None or not req.pending_ends_it(self.max_model_len):
                remaining = req.num_scheduled_tokens - req.num_computed_tokens
                kinds.add(self._natural_chunk(req, remaining) > ROWS_AS_DECODES)
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            kinds.add(self._natural_chunk(req, req.num_tokens) > ROWS_AS_DECODES)
        if len(kinds) == 1:
            return kinds.pop()
        return not self._long_step

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.held:
                i += 1
                continue
            if self.max_model_len is not None and req.pending_ends_it(self.max_model_len):
                i += 1  # its last token is on the device: nothing after it to compute
                continue
            remaining = req.num_scheduled_tokens - req.num_computed_tokens
            num_new = self._chunk(req, remaining, budget)
            if num_new == 0:  # batch-invariant mode: its chunk waits for a step it fits in
                i += 1
                continue
            # A decode's drafts ride along as far as the budget allows (in batch-invariant
            # mode's short steps the budget is ROWS_AS_DECODES: they attend as decodes).
            room = budget
            drafts = req.spec.drafts[: room - 1] if remaining == 1 else []
            num_new += len(drafts)
            while not self.block_manager.allocate_slots(
                req.request_id, req.all_token_ids, req.num_computed_tokens + num_new
            ):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.scheduled.append(ScheduledRequest(req, num_new, drafts))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # Prompt logprobs need every prompt row computed: no prefix-cache hits.
            wants_rows = req.sampling_params.prompt_logprobs is not None
            hits = [] if wants_rows else self.block_manager.get_computed_blocks(req.all_token_ids)
            num_cached = len(hits) * self.block_manager.block_size
            remaining = req.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._chunk(req, remaining, budget)
            if num_new == 0:
                break
            if not self.block_manager.allocate_slots(
                req.request_id, req.all_token_ids, num_cached + num_new, hits
            ):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _chunk(self, req: Request, remaining: int, budget: int) -> int:
        """Tokens to compute for a request now. In batch-invariant mode its natural chunk
        (`_natural_chunk`) if that is of this step's kind and fits, else none."""
        if self.config.invariant_chunk is None:
            return min(remaining, budget)
        chunk = self._natural_chunk(req, remaining)
        if (chunk > ROWS_AS_DECODES) != self._long_step:
            return 0
        return chunk if chunk <= budget else 0

    def _natural_chunk(self, req: Request, remaining: int) -> int:
        """Batch-invariant mode: a prompt is cut where a run alone cuts it (whole chunks of
        `invariant_chunk` from its start) and never past its end; the tokens after it (a
        recompute after preemption) go at most ROWS_AS_DECODES at a time, rows that
        attend as the decodes that first computed them."""
        done, prompt = req.num_computed_tokens, req.num_prompt_tokens
        limit = prompt - done if done < prompt else ROWS_AS_DECODES
        return min(remaining, self.config.invariant_chunk, limit)

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.held = False  # (a draft sequence: rewound at its next proposal)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def advance(self, out: SchedulerOutput) -> None:
        """After the model ran the step: the scheduled tokens are now in the KV cache
        (drafts too, until verification steps back over the rejected ones)."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.block_manager.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
