"""Sampling parameters, vLLM's names and defaults. Values out of range raise ValueError
naming the parameter, at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "an integer >= 1")
        if self.temperature < 0:
            fail("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", ">= 1")
        if self.min_tokens < 0:
            fail("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            fail("logprobs", ">= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "an integer or None")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            fail("stop", "a non-empty string or a list of non-empty strings")
        self._stop_list = stops
        if self.stop_token_ids is not None and any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the index-th of `n` samples: one sample, its own seed."""
        seed = None if self.seed is None else self.seed + index
        kwargs = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        kwargs.update(n=1, seed=seed)
        return SamplingParams(**kwargs)
