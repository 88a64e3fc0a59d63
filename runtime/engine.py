"""The engine: one step = schedule, run the model, sample, detokenize, check stops."""

from __future__ import annotations

import logging
import time
from typing import Any

from compilecore.config import EngineConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.executor import LocalExecutor
from runtime.model_runner import plan_step
from runtime.request import Request
from runtime.sampler import Sampler
from runtime.scheduler import Scheduler

logger = logging.getLogger("compilecore")


class LLMEngine:
    def __init__(self, engine_config: EngineConfig, tokenizer: Any, executor: Any = None):
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
            engine_config.scheduler_config, engine_config.cache_config, num_blocks
        )
        self.sampler = Sampler(engine_config.model_config.seed)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.eos_token_ids = _eos_token_ids(engine_config.model_config.hf_config, tokenizer)

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
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        if not out:
            return []
        plan, sampling = plan_step(out, self.scheduler.block_manager)
        logits = self.executor.execute(plan)
        self.scheduler.advance(out)
        if not sampling:
            return []
        requests = [s.request for s in sampling]
        sampled = self.sampler(
            logits, [r.sampling_params for r in requests], [r.generator for r in requests]
        )
        finished = []
        for req, token, logprobs in zip(requests, sampled.token_ids, sampled.logprobs):
            req.append_token(token)
            if logprobs is not None:
                req.output_logprobs.append(logprobs)
            if self._check_stop(req, token):
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        may_stop = n_out >= params.min_tokens
        stop_str = self.detokenizers[req.request_id].append(token, check_stop=may_stop)
        reason: str | None = None
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif may_stop and params.stop_token_ids and token in params.stop_token_ids:
            reason, req.stop_reason = "stop", token
        elif stop_str is not None:
            reason, req.stop_reason = "stop", stop_str
        elif (params.max_tokens is not None and n_out >= params.max_tokens) or (
            req.num_tokens >= self.config.model_config.max_model_len
        ):
            reason = "length"
        if reason is None:
            return False
        if stop_str is None:
            self.detokenizers[req.request_id].flush(check_stop=may_stop)
        req.finished_time = time.perf_counter()
        self.scheduler.finish(req, reason)
        return True

    def output_text(self, request_id: str) -> str:
        return self.detokenizers[request_id].text

    def release(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)


def _eos_token_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(hf_config, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return frozenset(ids)
