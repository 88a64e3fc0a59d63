"""What `LLM.generate` returns, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's `Logprob`: a token's log-probability in the raw distribution, its rank there
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (no token left)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


SPEC_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_generated_tokens: int
    num_cached_tokens: int = 0
    # Speculative decoding (vLLM's spec_decode counts): verification steps, tokens
    # proposed, and of those accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens (None: nothing proposed)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification step emitted, on average: 1 + accepted per step."""
        if not self.num_drafts:
            return None
        return 1 + self.num_accepted_tokens / self.num_drafts

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.first_token_time is None or self.finished_time is None:
            return None
        elapsed = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / elapsed if elapsed > 0 else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
