"""Turns the logits of the rows that sample into tokens, in vLLM's order.

Per row, on fp32 logits (`process_logits`), each step only where the request asks for it:

0. structured outputs: the tokens its grammar does not allow next -> -inf
1. `allowed_token_ids`: every other token -> -inf
2. `bad_words`: the last token of a banned word whose earlier tokens end the output -> -inf
3. `logit_bias`: added (vLLM clamps each bias to [-100, 100])
4. `min_tokens`: EOS and `stop_token_ids` -> -inf until that many tokens were generated
5. penalties: `repetition_penalty` over prompt and output tokens (positive logits divided,
   negative ones multiplied, as HF and vLLM do), then `frequency_penalty` x the token's
   count in the output and `presence_penalty` once for any token in the output

Greedy rows then take the argmax. Sampling rows are divided by their temperature, then
(`filter_logits`) min-p drops tokens below `min_p` x the top probability, top-k keeps every
token as large as the k-th (ties too, as vLLM), and top-p keeps the smallest prefix of the
distribution renormalized after top-k whose mass reaches `top_p`. On CPU the rows are
filtered and drawn in C (runtime/cpu_sampling.py: the same kept set found without sorting
the vocabulary, then one uniform through the inverse CDF; numpy where the kernel cannot be
built); elsewhere the token is drawn by the exponential race (argmax of p / q, q ~ Exp(1)).
Both equal sampling from p.
On CPU a request with a seed draws its randomness from its own generator, so its tokens do
not depend on the rest of the batch. On a GPU every row is drawn by one Triton kernel
(runtime/sample_kernel.py: the same filters without a sort, counter-based randomness keyed
by the request's `draw_seed` and the token's index), captured in the full CUDA graphs and
launched after any other step, so a token does not depend on which path drew it.

A row with no distribution to draw from gives the same token on every path
(`cpu_sampling.degenerate_row_token`): the first +inf logit where there is one, else, for a
nan logit or every logit -inf (the request's own constraints masked every token),
`NO_TOKEN`, and the engine finishes that request with finish_reason "error".

Logprobs are those of the raw distribution, before any of the above (vLLM's default
`logprobs_mode="raw_logprobs"`), with each token's rank in it (1 = most likely).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.cpu_sampling import NO_TOKEN, row_logprobs, sample_rows
from runtime.request import Request
from runtime.sampling_params import SamplingParams

NEG_INF = float("-inf")
_CPU = torch.device("cpu")
# What runtime/sample_kernel.py's launch does (its flag on the device): nothing, every row's
# argmax, or each row by its `Request.sample_row` parameters.
SAMPLE_OFF, SAMPLE_GREEDY, SAMPLE_PARAMS = 0, 1, 2


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token id: (logprob, rank)} of the top-n tokens and the sampled one, or None.
    logprobs: list[dict[int, tuple[float, int]] | None]


def process_logits(logits: torch.Tensor, requests: list[Request], eos_ids: frozenset[int]) -> None:
    """Steps 1-5 above, in place, on the rows of requests that use any of them."""
    for i, req in enumerate(requests):
        p = req.sampling_params
        if not (p.has_logits_processing or len(req.output_token_ids) < p.min_tokens):
            continue
        row, device = logits[i], logits.device
        if req.grammar is not None:  # the structured output's next tokens, first (vLLM)
            req.grammar.mask(row)
        if p.allowed_token_ids:
            keep = row.new_full(row.shape, NEG_INF)
            keep[list(p.allowed_token_ids)] = 0.0
            row += keep
        out = req.output_token_ids
        for word in req.bad_words_token_ids:
            if len(word) == 1 or out[len(out) - len(word) + 1 :] == word[:-1]:
                row[word[-1]] = NEG_INF
        if p.logit_bias:
            ids = list(p.logit_bias)
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype, device=device)
        if len(out) < p.min_tokens:
            stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_ids))
            if stops:
                row[sorted(stops)] = NEG_INF
        # Penalties index only the tokens seen, with every tensor on the logits' device (a
        # CPU-built one cannot index into or add to CUDA logits).
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_token_ids).union(out)), device=device)
            vals = row[seen]
            rp = p.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / rp, vals * rp)
        if (p.frequency_penalty or p.presence_penalty) and out:
            ids, counts = torch.tensor(out, device=device).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (renormalized after top-k): the logits of
    the tokens each row may still draw, -inf elsewhere."""
    device = logits.device
    temperature = _on_device([p.temperature for p in params], device)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = _on_device([p.min_p for p in params], device)
        probs = logits.softmax(dim=-1)
        drop = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(drop, NEG_INF)
    if any(p.uses_top_k or p.top_p < 1.0 for p in params):
        vocab = logits.shape[-1]
        top_k = _on_device([p.top_k if p.uses_top_k else vocab for p in params], device)
        top_p = _on_device([p.top_p for p in params], device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        # Every token as large as the k-th stays (vLLM's top-k keeps ties too).
        kth = sorted_logits.gather(-1, (top_k[:, None] - 1).clamp(max=vocab - 1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
        probs = sorted_logits.softmax(dim=-1)  # renormalized over what top-k kept
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def _on_device(values: list, device: torch.device) -> torch.Tensor:
    """A step's per-row values as a tensor on `device`, with no host sync: a CUDA copy from
    pinned memory is queued behind the step in flight, where one from pageable memory
    would wait for it (async scheduling launches the next step meanwhile)."""
    t = torch.tensor(values)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def argmax_rows(view: np.ndarray) -> list[int]:
    """Each row's first largest logit, or NO_TOKEN where that is nan or -inf (nothing to
    choose: `degenerate_row_token`). numpy's argmax takes the first nan, else the first
    +inf."""
    tokens = view.argmax(axis=-1).tolist()
    for i, token in enumerate(tokens):
        if not view[i, token] > NEG_INF:
            tokens[i] = NO_TOKEN
    return tokens


def _degenerate_rows(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` with the rows of `logits` that have no distribution given the tokens
    `degenerate_row_token` gives them, in torch on the logits' device (no sync)."""
    posinf = logits == float("inf")
    tokens = torch.where(posinf.any(dim=-1), posinf.to(torch.uint8).argmax(dim=-1), tokens)
    none = logits.isnan().any(dim=-1) | ~(logits > NEG_INF).any(dim=-1)
    return tokens.masked_fill(none, NO_TOKEN)


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        self._numpy_view: tuple[torch.Tensor, Any] | None = None
        self._scratch: np.ndarray | None = None
        self._params_flag: dict[torch.device, torch.Tensor] = {}
        # The keys of unseeded requests' GPU draws: a stream of their own, so that keying
        # a request leaves the CPU path's draws as they were.
        self._keys = random.Random(seed)

    def seed_request(self, req: Request) -> None:
        """Give a request without a seed the key of its GPU draws, from this sampler's
        seed: runs with the same `LLM(seed=...)` draw the same tokens."""
        if req.draw_seed is None:
            req.draw_seed = self._keys.getrandbits(64) - 2**63

    def _default_generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        eos_ids: frozenset[int] = frozenset(),
        graph_tokens: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """`graph_tokens`: the rows' tokens where a full CUDA graph drew them (every request
        plain: runtime/sample_kernel.py), read instead of the logits."""
        if graph_tokens is not None:
            return SamplerOutput(graph_tokens[: len(requests)].tolist(), [None] * len(requests))
        if (view := self._cpu_view(logits)) is not None:
            # The common decode step in as few calls as possible: each one is cold after the
            # weights have streamed through the caches, and a cached view needs no torch call
            # (`logits.dtype` and `.device` took ~40 us cold; docs/kernel-choices.md, Host
            # time).
            if all(r.plain_greedy for r in requests):
                return SamplerOutput(argmax_rows(view), [None] * len(requests))
            return self._sample_cpu(view, requests, eos_ids)
        if logits.dtype != torch.float32:
            logits = logits.float()
        if logits.device.type == "cpu":
            return self._sample_cpu(self._numpy(logits), requests, eos_ids)
        return self._sample_torch(logits, requests, eos_ids)

    def device_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The tokens of rows whose requests are all `plain` (no logprobs, no logits
        processing), int64 on the logits' device: on a GPU nothing is read back to the
        host, so async scheduling launches the next step before they are read. On CPU,
        the host sampler's (no device to wait for; the same draws as without async
        scheduling)."""
        if logits.device.type == "cpu":
            return torch.tensor(self(logits, requests).token_ids)
        return self._draw(logits.float(), requests)

    def _sample_torch(
        self, logits: torch.Tensor, requests: list[Request], eos_ids: frozenset[int]
    ) -> SamplerOutput:
        """Rows of fp32 logits on any device (CUDA's path; the oracle of the CPU one):
        processed, filtered and drawn by the exponential race in torch."""
        params = [r.sampling_params for r in requests]
        raw = logits
        if any(p.has_logits_processing or p.min_tokens for p in params):
            logits = logits.clone()
            process_logits(logits, requests, eos_ids)
        token_list = self._draw(logits, requests).tolist()
        return SamplerOutput(token_list, self._logprobs(raw, params, token_list))

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's token, int64 on the logits' device, with no value read back to the
        host: greedy rows' argmax, the others' exponential race, and the degenerate rows'
        token where a row has no distribution. On CUDA, runtime/sample_kernel.py's (the
        full graphs' own); elsewhere in torch (the tests' oracle)."""
        if logits.device.type == "cuda":
            return self._draw_kernel(logits, requests)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if len(random_rows) == len(requests):
            tokens = self._sample(logits, requests)
        else:
            tokens = logits.argmax(dim=-1)
            if random_rows:
                rows = _on_device(random_rows, logits.device)
                tokens[rows] = self._sample(logits[rows], [requests[i] for i in random_rows])
        return _degenerate_rows(logits, tokens)

    def _draw_kernel(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        from runtime.sample_kernel import sample_tokens  # imports Triton

        for req in requests:
            self.seed_request(req)
        floats, ints = zip(*(req.sample_row() for req in requests))
        device = logits.device
        if device not in self._params_flag:
            self._params_flag[device] = torch.full((1,), SAMPLE_PARAMS, dtype=torch.int32,
                                                   device=device)  # fmt: skip
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        return sample_tokens(logits, self._params_flag[device], _on_device(floats, device),
                             _on_device(ints, device))  # fmt: skip

    def _sample_cpu(
        self, raw: np.ndarray, requests: list[Request], eos_ids: frozenset[int]
    ) -> SamplerOutput:
        """Rows of fp32 logits (`raw`, a numpy view), each processed in torch (on a copy)
        where its request asks, then drawn and its logprobs taken by
        runtime/cpu_sampling.py."""
        view = raw
        if not all(r.plain for r in requests) and any(
            r.sampling_params.has_logits_processing or r.sampling_params.min_tokens
            for r in requests
        ):
            view = raw.copy()
            process_logits(torch.from_numpy(view), requests, eos_ids)
        scratch = self._weights(raw)
        params = [r.sampling_params for r in requests]
        tokens = argmax_rows(view) if any(p.greedy for p in params) else []
        drawn = [
            (i, p, self.uniform(r))
            for i, (r, p) in enumerate(zip(requests, params))
            if not p.greedy
        ]
        if drawn:
            tokens = tokens or [0] * len(requests)
            for (i, _, _), token in zip(drawn, sample_rows(view, drawn, scratch)):
                tokens[i] = token
        logprobs = [
            None
            if p.logprobs is None or tokens[i] == NO_TOKEN
            else row_logprobs(raw[i], tokens[i], p.top_logprobs("logprobs", raw.shape[-1]), scratch)
            for i, p in enumerate(params)
        ]
        return SamplerOutput(tokens, logprobs)

    def _cpu_view(self, logits: torch.Tensor) -> Any:
        """`_numpy(logits)` for fp32 CPU logits, None for any other (the cached view's
        tensor was checked when it was cached)."""
        cached = self._numpy_view is not None and self._numpy_view[0] is logits
        if not cached and (logits.device.type != "cpu" or logits.dtype != torch.float32):
            return None
        return self._numpy(logits)

    def _numpy(self, logits: torch.Tensor) -> Any:
        """`logits.numpy()`, kept while the same tensor comes back: a CPU graph returns
        its one output buffer every step, and after a batch-1 step has streamed the weights
        through the caches a fresh `numpy()` costs ~70 us (docs/kernel-choices.md, Host time).
        Holds the last step's logits until the next step's arrive. numpy's argmax is vectorized;
        torch's takes ~10x longer on a 49k vocabulary. Ties: the first index."""
        if self._numpy_view is None or self._numpy_view[0] is not logits:
            self._numpy_view = (logits, logits.numpy())
        return self._numpy_view[1]

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = filter_logits(logits, [r.sampling_params for r in requests]).softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, req in enumerate(requests):
            noise[i].exponential_(generator=self._generator(req, logits.device))
        # Exp(1) can return 0 (probability ~2^-24 per draw in fp32): p / 0 would be inf or
        # nan and win the race whatever p is.
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _weights(self, view: Any) -> Any:
        """A row-sized fp32 buffer for `sample_row` and `row_logprobs`, kept across steps."""
        if self._scratch is None or self._scratch.shape[0] != view.shape[-1]:
            self._scratch = np.empty(view.shape[-1], dtype=np.float32)
        return self._scratch

    def uniform(self, req: Request) -> float:
        """One draw from [0, 1) with 53 random bits, from the request's generator (drawn 64
        at a time: one torch call a step costs more than the row's sampling, cold)."""
        if not req.uniforms:
            generator = self._generator(req, _CPU)
            req.uniforms = torch.rand(64, dtype=torch.float64, generator=generator).tolist()
        return req.uniforms.pop()

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self._default_generator(device)
        if req.generator is None or req.generator.device != device:
            req.generator = torch.Generator(device=device).manual_seed(seed)
        return req.generator

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
    ) -> list[dict[int, tuple[float, int]] | None]:
        wanted = [p.top_logprobs("logprobs", logits.shape[-1]) for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logprobs = logits.log_softmax(dim=-1)
        top_n = min(max(n or 0 for n in wanted), logits.shape[-1])  # at most every token
        top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        out: list[dict[int, tuple[float, int]] | None] = []
        for i, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            value = logprobs[i, tokens[i]]
            rank = int((logprobs[i] > value).sum().item()) + 1
            entry = {tokens[i]: (value.item(), rank)}
            if n:
                ids, vals = top_ids[i, :n].tolist(), top_vals[i, :n].tolist()
                entry.update({t: (v, r + 1) for r, (t, v) in enumerate(zip(ids, vals))})
            out.append(entry)
        return out
