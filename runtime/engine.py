"""The engine: one step = schedule, run the model, sample, detokenize, check stops.

A step that raises (the model, the sampler, a detokenizer) aborts the requests it
scheduled, frees their KV blocks and re-raises: the engine keeps serving the others. A row
the sampler cannot draw from (a nan logit, or the request's own constraints masked every
token) finishes its request with finish_reason "error", keeping what it generated."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from compilecore.config import EngineConfig
from runtime import cpu_sampling
from runtime.async_scheduling import InflightStep
from runtime.detokenizer import IncrementalDetokenizer, NullDetokenizer
from runtime.executor import LocalExecutor
from runtime.model_runner import DraftRows, PromptLogprobRows, plan_step
from runtime.outputs import SPEC_COUNTS, Logprob
from runtime.request import Request
from runtime.sampler import NO_TOKEN, Sampler, argmax_rows, filter_logits
from runtime.scheduler import Scheduler, SchedulerOutput
from runtime.spec_decode import (
    DraftModelProposer,
    Proposer,
    accepted_length,
    sample_verified,
)
from runtime.structured_output import GrammarCompilerCache

logger = logging.getLogger("compilecore")


class LLMEngine:
    def __init__(
        self, engine_config: EngineConfig, tokenizer: Any, executor: Any = None, draft: Any = None
    ):
        self.config = engine_config
        self.tokenizer = tokenizer
        self.executor = executor or LocalExecutor(engine_config)
        # Rank 0's shard, for looking inside (the compiled model, the runner).
        self.model, self.runner = self.executor.worker.model, self.executor.worker.runner
        num_blocks = self._num_kv_blocks()
        engine_config.cache_config.num_gpu_blocks = num_blocks
        self.executor.init_cache(num_blocks)
        self.compile_seconds = self.executor.worker.compile_seconds
        self.scheduler = Scheduler(
            engine_config.scheduler_config, engine_config.cache_config, num_blocks,
            engine_config.model_config.max_model_len,
        )  # fmt: skip
        # Async scheduling: the launched step whose tokens the host has not read yet, and
        # how many steps took input ids from the step before on the device.
        self._inflight: InflightStep | None = None
        self.num_fed_steps = 0
        spec = engine_config.speculative_config
        max_len = engine_config.model_config.max_model_len
        # `draft`: the draft model's engine (speculative_config's "draft_model" method).
        self.proposer = None
        if spec is not None and spec.model is not None and draft is None:
            raise ValueError(f"speculative_config names a draft model ({spec.model}): pass its "
                             "engine as `draft` (runtime.LLM builds it)")  # fmt: skip
        if spec is not None:
            self.proposer = (
                DraftModelProposer(spec, max_len, draft) if draft else Proposer(spec, max_len)
            )
        # Since the start, over every request (vLLM's spec_decode counters).
        self.spec_counts = dict.fromkeys(SPEC_COUNTS, 0)
        self.sampler = Sampler(engine_config.model_config.seed)
        self._device_draws = engine_config.device.type == "cuda"  # plan_step's sample_rows
        if engine_config.device.type == "cpu":
            cpu_sampling.build()  # now, not at the first sampled token (~1 s on first use)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer | NullDetokenizer] = {}
        self.eos_token_ids = eos_token_ids(engine_config.model_config, tokenizer)
        self._grammars: GrammarCompilerCache | None = None

    def grammars(self) -> GrammarCompilerCache:
        """The structured-output grammar compiler (made on first use: xgrammar)."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init)")
        if self._grammars is None:
            vocab = self.config.model_config.hf_config.vocab_size
            stops = sorted(self.eos_token_ids)
            self._grammars = GrammarCompilerCache(self.tokenizer, vocab, stops)
        return self._grammars

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache_config
        per_block = self.runner.kv_cache_bytes_per_block()
        budget = self.executor.worker.kv_budget_bytes()
        num_blocks = self.executor.num_kv_blocks()
        max_len = self.config.model_config.max_model_len
        needed = -(-max_len // cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds {num_blocks} blocks, but one request "
                f"of max_model_len={max_len} tokens needs {needed} blocks ({needed * per_block} "
                "bytes): raise kv_cache_memory or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            cache.block_size,
            num_blocks * per_block / 2**20,
        )
        return num_blocks

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.tokenizer is None or not params.detokenize:
            detokenizer: Any = NullDetokenizer()
        else:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        if params.structured_outputs is not None:
            request.grammar = self.grammars().matcher(params.structured_outputs)
        self.sampler.seed_request(request)
        self.detokenizers[request.request_id] = detokenizer
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop these requests now (finish_reason "abort") and free their KV blocks;
        unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            req = self.requests.pop(rid, None)
            self.detokenizers.pop(rid, None)
            if req is not None and not req.is_finished:
                req.finished_time = time.perf_counter()
                self.scheduler.finish(req, "abort")
                if self.proposer is not None:
                    self.proposer.forget(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it. If the step raises,
        the requests it scheduled are aborted first (the others are untouched). With
        async scheduling a step launches the next one and then reads the last one's
        tokens (runtime/async_scheduling.py): what finishes is one step late."""
        pipelined = self._can_pipeline()
        if self._inflight is not None and not pipelined:
            return self._read_inflight()  # a step that samples on the host waits for it
        if self.proposer is not None:
            self.proposer.propose_all(self.scheduler.running)
        out = self.scheduler.schedule()
        if not out:
            return self._read_inflight()
        try:
            return self._run_pipelined(out) if pipelined else self._run(out)
        except BaseException as exc:
            failed = [s.request.request_id for s in out.scheduled]
            self.abort_request(failed)
            if hasattr(exc, "add_note"):
                exc.add_note(f"compilecore: aborted the requests of the failed step: {failed}")
            raise

    def _can_pipeline(self) -> bool:
        """Async scheduling is on and every live request samples on the device (no
        logprobs, logits processing, grammar or prompt logprobs): steps may overlap."""
        if not self.config.scheduler_config.async_scheduling:
            return False
        live = (*self.scheduler.running, *self.scheduler.waiting)
        return all(r.plain and r.grammar is None
                   and r.sampling_params.prompt_logprobs is None for r in live)  # fmt: skip

    def _run_pipelined(self, out: SchedulerOutput) -> list[Request]:
        plan, sampling, _, _ = plan_step(out, self.scheduler.block_manager, self._device_draws)
        last = self._inflight
        feed = last.feed(plan.fed) if last is not None else None
        self.num_fed_steps += feed is not None
        logits = self.executor.execute(plan, feed)
        self.scheduler.advance(out)
        launched = None
        if sampling:
            requests = [s.request for s in sampling]
            tokens = self.executor.graph_tokens()  # drawn in its full CUDA graph
            if tokens is None:
                tokens = self.sampler.device_tokens(logits[: len(requests)], requests)
            launched = InflightStep(requests, tokens)
        self._inflight = launched
        return self._read(last) if last is not None else []

    def _read_inflight(self) -> list[Request]:
        last, self._inflight = self._inflight, None
        return self._read(last) if last is not None else []

    def _read(self, step: InflightStep) -> list[Request]:
        """A launched step's tokens, appended and checked for stops (one step late)."""
        finished = []
        for req, token in zip(step.requests, step.host_tokens()):
            if req.is_finished:  # aborted, or stopped by its token of the step before
                continue
            if token == NO_TOKEN:
                self._finish(req, "error")
                finished.append(req)
                continue
            req.append_token(token)
            if self._check_stop(req, token):
                finished.append(req)
        return finished

    def _run(self, out: SchedulerOutput) -> list[Request]:
        blocks = self.scheduler.block_manager
        plan, sampling, prompt_rows, draft_rows = plan_step(out, blocks, self._device_draws)
        logits = self.executor.execute(plan)
        self.scheduler.advance(out)
        for rows in prompt_rows:
            self._prompt_logprobs(rows, logits[rows.start : rows.start + rows.count])
        finished = []
        for rows in draft_rows:
            count = len(rows.drafts) + 1
            finished += self._verify(rows, logits[rows.start : rows.start + count])
        if sampling:
            requests = [s.request for s in sampling]
            if len(requests) != len(plan.logits_rows):  # no torch call otherwise: each is cold
                logits = logits[: len(requests)]
            finished += self._append_sampled(requests, logits, self.executor.graph_tokens())
        return finished

    def _append_sampled(self, requests: list[Request], logits, graph_tokens=None) -> list[Request]:
        """Each request's token drawn from its row (`graph_tokens`: a step's tokens drawn in
        its full CUDA graph), appended and checked for stops."""
        sampled = self.sampler(logits, requests, self.eos_token_ids, graph_tokens)
        finished = []
        for req, token, logprobs in zip(requests, sampled.token_ids, sampled.logprobs):
            if token == NO_TOKEN:  # nothing could be drawn: the request ends here
                self._finish(req, "error")
                finished.append(req)
                continue
            req.append_token(token)
            if logprobs is not None:
                req.output_logprobs.append(self._logprob_objects(logprobs, req))
            if req.grammar is not None and not req.grammar.accept(token):
                self._finish(req, "error")  # cannot happen: the mask allowed only these
                finished.append(req)
            elif self._check_stop(req, token):
                finished.append(req)
            elif req.grammar is not None and req.grammar.complete:
                self._finish(req, "stop")  # the grammar took its end (EOS under ignore_eos)
                finished.append(req)
        return finished

    def _verify(self, rows: DraftRows, logits) -> list[Request]:
        """A request's drafts against its rows (runtime/spec_decode.py: greedy, or by the
        rejection rule): the accepted drafts and the token after them are appended one by
        one through the stop checks; the computed count steps back over the rejected."""
        req, drafts = rows.request, rows.drafts
        if req.grammar is not None:  # row i: the tokens allowed after d1..di
            logits = logits.float().clone()
            req.grammar.mask_rows(logits, drafts)
        if req.sampling_params.greedy and req.grammar is not None:
            targets = argmax_rows(logits.cpu().numpy())  # the sampler would mask row 0's way
            accepted = accepted_length(targets, drafts)
        elif req.sampling_params.greedy:  # degenerate rows: the sampler's own rule per row
            targets = self.sampler(logits, [req] * len(logits), self.eos_token_ids).token_ids
            accepted = accepted_length(targets, drafts)
        elif not _drawable(logits):  # row 0 as a plain step treats it; no draft kept
            targets = self.sampler(logits[:1], [req], self.eos_token_ids).token_ids
            accepted = 0
        else:  # only requests whose draws nothing but the filters shape (Proposer.eligible)
            probs = filter_logits(logits.float(), [req.sampling_params] * len(logits))
            targets = sample_verified(
                probs.softmax(dim=-1), drafts, lambda: self.sampler.uniform(req)
            )
            accepted = len(targets) - 1
        req.num_computed_tokens -= len(drafts) - accepted
        self.proposer.record(req, len(drafts), accepted)
        for name, n in zip(SPEC_COUNTS, (1, len(drafts), accepted)):
            self.spec_counts[name] += n
        for token in targets[: accepted + 1]:
            if token == NO_TOKEN:
                self._finish(req, "error")
                return [req]
            req.append_token(token)
            if req.grammar is not None and not req.grammar.accept(token):
                self._finish(req, "error")  # cannot happen: each row's mask allowed only these
                return [req]
            if self._check_stop(req, token):
                return [req]
            if req.grammar is not None and req.grammar.complete:
                self._finish(req, "stop")
                return [req]
        return []

    def _prompt_logprobs(self, rows: PromptLogprobRows, logits) -> None:
        """Logprobs of the prompt tokens after `rows.first` (the raw distribution, as for
        sampled tokens): the sampled-token entry is the prompt's actual next token."""
        req = rows.request
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # nothing predicts the first prompt token
        n = req.sampling_params.top_logprobs("prompt_logprobs", logits.shape[-1])
        logprobs = logits.float().log_softmax(dim=-1)
        nxt = req.prompt_token_ids[rows.first + 1 : rows.first + 1 + rows.count]
        top = min(n, logprobs.shape[-1])  # beyond the vocabulary: every token
        top_vals, top_ids = logprobs.topk(top, dim=-1) if n else (None, None)
        for j, token in enumerate(nxt):
            if rows.first + j + 1 < len(req.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            value = logprobs[j, token]
            entry = {token: (value.item(), int((logprobs[j] > value).sum().item()) + 1)}
            if n:
                pairs = zip(top_ids[j].tolist(), top_vals[j].tolist())
                entry.update({t: (v, r + 1) for r, (t, v) in enumerate(pairs)})
            req.prompt_logprobs.append(self._logprob_objects(entry, req))

    def _logprob_objects(
        self, entry: dict[int, tuple[float, int]], req: Request
    ) -> dict[int, Logprob]:
        def text(token: int) -> str | None:
            if self.tokenizer is None or not req.sampling_params.detokenize:
                return None
            return self.tokenizer.decode([token], skip_special_tokens=False)

        return {t: Logprob(v, rank, text(t)) for t, (v, rank) in entry.items()}

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        may_stop = n_out >= params.min_tokens
        # vLLM checks stop strings only once the output is longer than min_tokens (stop
        # tokens from min_tokens on, masked before): a string never ends it one token early.
        may_stop_str = n_out > params.min_tokens
        detokenizer = self.detokenizers[req.request_id]
        reason: str | None = None
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif may_stop and params.stop_token_ids and token in params.stop_token_ids:
            reason, req.stop_reason = "stop", token
        # A stop token's text stays out of the output unless asked for (vLLM).
        if reason is None or params.include_stop_str_in_output:
            stop_str = detokenizer.append(token, check_stop=may_stop_str)
            if stop_str is not None and reason is None:
                reason, req.stop_reason = "stop", stop_str
        if reason is None and (
            (params.max_tokens is not None and n_out >= params.max_tokens)
            or req.num_tokens >= self.config.model_config.max_model_len
        ):
            reason = "length"
        if reason is None:
            return False
        if not isinstance(req.stop_reason, str):  # text held back may still end in a stop
            flushed = detokenizer.flush(check_stop=may_stop_str)
            if flushed is not None:
                reason, req.stop_reason = "stop", flushed
        self._finish(req, reason)
        return True

    def _finish(self, req: Request, reason: str) -> None:
        req.finished_time = time.perf_counter()
        self.scheduler.finish(req, reason)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)

    def output_text(self, request_id: str) -> str:
        return self.detokenizers[request_id].text

    def release(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.requests.pop(request_id, None)


def _drawable(logits) -> bool:
    """Whether every row has a distribution: no nan or +inf, not all -inf (the sampler's
    degenerate rows, each with a rule of its own)."""
    bad = logits.isnan() | (logits == float("inf"))
    return bool((logits.isfinite().any(dim=-1).all() & ~bad.any()).item())


def eos_token_ids(model_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the tokenizer, the model config and generation_config.json (which
    often lists extra ones, such as a chat model's end-of-turn token)."""
    ids: set[int] = set()
    sources = [
        getattr(tokenizer, "eos_token_id", None),
        getattr(model_config.hf_config, "eos_token_id", None),
        getattr(getattr(model_config, "generation_config", None), "eos_token_id", None),
    ]
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    return frozenset(ids)
