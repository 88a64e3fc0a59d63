"""A request as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.sampling_params import SamplingParams


@dataclass
class SpecState:
    """A request's speculative decoding (runtime/spec_decode.py): the drafts of its next
    step, its counts (RequestMetrics), whether it watches its lookups instead of verifying
    them (and the lookup it watches), and a draft model's pause after a low acceptance."""

    drafts: list[int] = field(default_factory=list)
    num_drafts: int = 0  # verification steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Tokens accepted per verification (or watched lookup), halved toward each new outcome.
    score: float = 0.0
    shadow: list[int] = field(default_factory=list)  # drafts not sent, judged by what follows
    shadow_at: int = 0  # the request's token count when they were proposed
    pause: int = 0  # steps left without proposals
    next_pause: int = 4


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Any]] = field(default_factory=list)  # of outputs.Logprob
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Made by the sampler on the logits' device for a request with a seed.
    generator: torch.Generator | None = None
    # The key of its draws on a GPU (runtime/sample_kernel.py): its seed as an int64, or,
    # without one, drawn by the engine's sampler when the request arrives.
    draw_seed: int | None = None
    # Each bad word as token ids (with and without a leading space), set by the LLM.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Any] | None] = field(default_factory=list)
    # The request's place in its structured-output grammar (set by the engine), or None.
    grammar: Any = None
    # Tokens sampled on the device whose ids the host has not read yet (async scheduling:
    # runtime/async_scheduling.py); the scheduler counts them as the request's next inputs.
    num_pending: int = 0
    spec: SpecState = field(default_factory=SpecState)
    # A draft model's sequence between proposals (runtime/spec_decode.py): the scheduler
    # keeps its KV and computes nothing for it.
    held: bool = False

    def __post_init__(self) -> None:
        # One list for prompt and output, appended in place: the block hashes and the
        # model runner read it every step.
        self.all_token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        # The sampler's short paths: nothing changes the logits and no logprobs; greedy.
        self.plain = not (p.has_logits_processing or p.min_tokens) and p.logprobs is None
        self.plain_greedy = p.greedy and self.plain
        # Speculation's requests (runtime/spec_decode.py): plain, or plain but for a grammar,
        # whose masks a verification's rows take one by one.
        self.plain_but_grammar = (
            p.structured_outputs is not None
            and not (p.has_token_processing or p.min_tokens)
            and p.logprobs is None
        )
        # Uniform draws from this request's generator, made in batches by the sampler and
        # taken from the end, one a sampled token.
        self.uniforms: list[float] = []
        if p.seed is not None:
            self.draw_seed = (p.seed + 2**63) % 2**64 - 2**63

    def sample_row(self) -> tuple[tuple[float, float, float], tuple[int, int, int]]:
        """Its next token's parameters for runtime/sample_kernel.py: (temperature, 0 for
        greedy; top_p; min_p) and (top_k, 0 for none; seed; the index of the token among
        its outputs, counting those still on the device)."""
        p = self.sampling_params
        temperature = 0.0 if p.greedy else p.temperature
        top_k = p.top_k if p.uses_top_k else 0
        position = len(self.output_token_ids) + self.num_pending
        return (temperature, p.top_p, p.min_p), (top_k, self.draw_seed or 0, position)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """The tokens a step may compute: the known ones and those still on the device."""
        return len(self.all_token_ids) + self.num_pending

    def pending_ends_it(self, max_model_len: int) -> bool:
        """Whether a pending token, once read, ends the request by length: no step need
        compute after it."""
        if not self.num_pending:
            return False
        limit = self.sampling_params.max_tokens
        n_out = len(self.output_token_ids) + self.num_pending
        return (limit is not None and n_out >= limit) or self.num_scheduled_tokens >= max_model_len

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
