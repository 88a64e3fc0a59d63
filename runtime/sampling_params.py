"""Sampling parameters, vLLM's names, defaults and ranges. A value out of range raises
ValueError naming the parameter, at construction, before anything is queued."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from runtime.structured_output import StructuredOutputsParams

_EPS = 1e-5
# torch.Generator.manual_seed takes any value in [-2**63, 2**64).
SEED_RANGE = (-(2**63), 2**64)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


class RequestOutputKind(enum.Enum):
    """vLLM's: what `AsyncLLM.generate` yields as tokens arrive. CUMULATIVE: everything so
    far; DELTA: only what is new; FINAL_ONLY: one output when the request ends."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Keep only the prompt's last k tokens (-1: as many as max_model_len leaves room for).
    truncate_prompt_tokens: int | None = None
    # False: token ids only, no text (vLLM's name); stop strings then have nothing to match.
    detokenize: bool = True
    # vLLM's detokenizer option for slow tokenizers; fast tokenizers (all ours) ignore it,
    # as vLLM's fast path does. Accepted so vLLM scripts run unchanged.
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None  # for user code; the engine never reads it
    # vLLM's V1 dropped best_of > n; frameworks still pass best_of=1 (or n).
    best_of: int | None = None
    # The output held to a JSON schema, a regex, a choice or a grammar (vLLM's current name;
    # `guided_decoding` is its older one): runtime/structured_output.py.
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        for name, low, high in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
            value = getattr(self, name)
            if not _is_real(value) or not low <= value <= high:
                fail(name, f"a number in [{low}, {high}]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "a finite number > 0")
        if not _is_real(self.temperature) or self.temperature < 0:
            fail("temperature", "a finite number >= 0")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "-1, 0 (disabled) or a positive integer")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                fail(name, "an integer >= 0, -1 (every token) or None")
        if self.seed == -1 and _is_int(self.seed):  # vLLM's spelling of "no seed"
            self.seed = None
        if self.seed is not None:
            last = self.seed + self.n - 1 if _is_int(self.seed) else None
            if last is None or not (SEED_RANGE[0] <= self.seed and last < SEED_RANGE[1]):
                fail("seed", "an integer in [-2**63, 2**64 - n] or None")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            fail("stop", "a non-empty string or a list of non-empty strings")
        self._stop_list = stops
        if self.stop_token_ids is not None and any(
            not _is_int(t) or t < 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "a list of non-negative integers")
        if self.logit_bias is not None:
            # Keys may arrive as strings (JSON); vLLM clamps each bias to [-100, 100].
            try:
                bias = {int(k): v for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                bias = None
            if bias is None or any(t < 0 or not _is_real(v) for t, v in bias.items()):
                fail("logit_bias", "a dict of token id -> finite number")
            self.logit_bias = {t: max(-100.0, min(100.0, float(v))) for t, v in bias.items()}
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "a non-empty list of non-negative integers")
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            fail("bad_words", "a list of non-empty strings")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or t >= 1)):
            fail("truncate_prompt_tokens", "-1 (the longest that fits), an integer >= 1 or None")
        for name in ("detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "True or False")
        if not self.detokenize and stops:
            fail("stop", "empty when detokenize=False (stop strings match the text)")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            fail("extra_args", "a dict or None")
        try:
            if self.guided_decoding is not None:
                if self.structured_outputs is not None:
                    raise ValueError("set structured_outputs or guided_decoding, not both")
                self.structured_outputs, self.guided_decoding = self.guided_decoding, None
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        except ValueError as e:
            raise ValueError(f"structured_outputs must be valid: {e}") from None
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "a RequestOutputKind")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            fail("best_of", f"None or n ({self.n}): more candidates than returned samples "
                 "is not supported (nor in vLLM's V1 engine)")  # fmt: skip

    def top_logprobs(self, name: str, vocab: int) -> int | None:
        """How many top logprobs `logprobs` or `prompt_logprobs` asks for: -1 is every
        token of the vocabulary (vLLM's V1)."""
        value = getattr(self, name)
        return vocab if value == -1 else value

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def has_logits_processing(self) -> bool:
        """Whether the logits of this request change before sampling (besides min_tokens,
        which the sampler checks per step)."""
        return bool(self.structured_outputs) or self.has_token_processing

    @property
    def has_token_processing(self) -> bool:
        """Whether the logits change by anything but a structured output's grammar."""
        return bool(
            self.allowed_token_ids
            or self.bad_words
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )

    def token_ids_used(self) -> list[int]:
        """Every token id these params name (checked against the vocabulary)."""
        return [
            *(self.stop_token_ids or []),
            *(self.logit_bias or {}),
            *(self.allowed_token_ids or []),
        ]

    def clone(self) -> SamplingParams:
        """A copy whose lists and dicts are its own (vLLM's `clone`)."""
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the index-th of `n` samples: one sample, its own seed."""
        seed = None if self.seed is None else self.seed + index
        kwargs = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        kwargs.update(n=1, seed=seed, best_of=None)
        return SamplingParams(**kwargs)
