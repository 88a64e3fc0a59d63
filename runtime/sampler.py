"""Turns the logits of the rows that sample into tokens, in vLLM's order.

Per row, on fp32 logits (`process_logits`), each step only where the request asks for it:

1. `allowed_token_ids`: every other token -> -inf
2. `bad_words`: the last token of a banned word whose earlier tokens end the output -> -inf
3. `logit_bias`: added (vLLM clamps each bias to [-100, 100])
4. `min_tokens`: EOS and `stop_token_ids` -> -inf until that many tokens were generated
5. penalties: `repetition_penalty` over prompt and output tokens (positive logits divided,
   negative ones multiplied, as HF and vLLM do), then `frequency_penalty` x the token's
   count in the output and `presence_penalty` once for any token in the output

Greedy rows then take the argmax. Sampling rows are divided by their temperature, then
(`filter_logits`) min-p drops tokens below `min_p` x the top probability, top-k keeps the k
largest, and top-p keeps the smallest prefix of the distribution renormalized after top-k
whose mass reaches `top_p`. On CPU each row is filtered and drawn in numpy (`sample_row`:
the same kept set found without sorting the vocabulary, then one uniform through the
inverse CDF); elsewhere the token is drawn by the exponential race (argmax of p / q,
q ~ Exp(1)). Both equal sampling from p. A request with a seed draws its randomness from its
own generator, on the logits' device, so its tokens do not depend on the rest of the batch.

Logprobs are those of the raw distribution, before any of the above (vLLM's default
`logprobs_mode="raw_logprobs"`), with each token's rank in it (1 = most likely).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.request import Request
from runtime.sampling_params import SamplingParams

NEG_INF = float("-inf")
_CPU = torch.device("cpu")


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
        row = logits[i]
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
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype)
        if len(out) < p.min_tokens:
            stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_ids))
            if stops:
                row[sorted(stops)] = NEG_INF
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(out)), dtype=torch.long)
            vals = row[seen]
            rp = p.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / rp, vals * rp)
        if (p.frequency_penalty or p.presence_penalty) and out:
            counts = torch.bincount(torch.tensor(out), minlength=row.shape[0])[: row.shape[0]]
            row -= p.frequency_penalty * counts.to(row.dtype)
            row -= p.presence_penalty * (counts > 0).to(row.dtype)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (renormalized after top-k): the logits of
    the tokens each row may still draw, -inf elsewhere."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = logits.softmax(dim=-1)
        drop = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(drop, NEG_INF)
    if any(p.uses_top_k or p.top_p < 1.0 for p in params):
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.uses_top_k else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
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


# Candidate thresholds for top-k and top-p, as weights relative to the top token's: the
# tokens at or above one are all that precede the rest in sorted order, so when they hold
# the top-k or the top-p mass, the kept set is found among them alone. A whole-row sort of
# a 49k vocabulary takes ~3 ms on this CPU, a threshold pass ~20 us. A model's logits span
# tens of units, so at low temperatures the top 50 can reach down to 1e-25.
_THRESHOLDS = (1e-1, 1e-2, 1e-3, 1e-4, 1e-6, 1e-9, 1e-14, 1e-20, 1e-30)
_BLOCK = 1024  # inverse CDF over a whole row: per-block sums first, then one block's cumsum


def sample_row(
    logits: np.ndarray, params: SamplingParams, u: float, out: np.ndarray | None = None
) -> int:
    """One token from a row of fp32 logits: the uniform draw `u` in [0, 1) picks among the
    tokens `kept_weights` keeps by the inverse CDF of their renormalized probabilities."""
    top = logits.max()
    if not np.isfinite(top):  # +inf or nan logits: no distribution to draw from
        return int(logits.argmax())
    ids, weights = kept_weights(logits, params, out)
    token = _draw(weights, u)
    return token if ids is None else int(ids[token])


def kept_weights(
    logits: np.ndarray, params: SamplingParams, out: np.ndarray | None = None
) -> tuple[np.ndarray | None, np.ndarray]:
    """The tokens temperature, min-p, top-k and top-p keep (those `filter_logits` keeps)
    and their unnormalized probabilities: (ids, weights), or (None, a weight per token)
    where no filter applies. `out`: a buffer like `logits` for the weights (a fresh one
    each step costs more than the math, cold)."""
    weights = np.subtract(logits, logits.max(), out=np.empty_like(logits) if out is None else out)
    weights *= np.float32(1.0 / params.temperature)
    np.exp(weights, out=weights)  # the top token's weight is 1
    if params.min_p > 0:
        weights[weights < params.min_p] = 0.0  # probability below min_p x the top one's
    if not (params.uses_top_k or params.top_p < 1.0):
        return None, weights
    k = params.top_k if params.uses_top_k else 0
    total = 0.0 if k else weights.sum(dtype=np.float64)
    ids = _candidates(weights, k, params.top_p * total)
    kept = weights[ids]
    if k and len(ids) > k:  # every token as heavy as the k-th (vLLM keeps ties too)
        keep = kept >= np.partition(kept, len(ids) - k)[len(ids) - k]
        ids, kept = ids[keep], kept[keep]
    if params.top_p < 1.0:  # the smallest prefix whose mass reaches top_p, the first always
        total = kept.sum(dtype=np.float64) if k else total  # renormalized after top-k
        heaviest = np.sort(kept)[::-1].astype(np.float64)
        before = np.cumsum(heaviest) - heaviest
        n = max(1, int(np.searchsorted(before, params.top_p * total)))
        keep = kept >= heaviest[n - 1]
        ids, kept = ids[keep], kept[keep]
    return ids, kept.astype(np.float64)


def _candidates(weights: np.ndarray, k: int, need: float) -> np.ndarray:
    """Ids, in vocabulary order, of tokens of nonzero weight that include the k heaviest
    (k > 0) or the heaviest tokens holding `need` of the weight (k = 0)."""
    for threshold in _THRESHOLDS:
        ids = np.flatnonzero(weights >= threshold)
        if (len(ids) >= k) if k else (weights[ids].sum(dtype=np.float64) >= need):
            return ids
    return np.flatnonzero(weights)  # tokens of weight 0 are never drawn


def _draw(weights: np.ndarray, u: float) -> int:
    """Index i with probability weights[i] / weights.sum(), by the inverse CDF of `u`."""
    if len(weights) <= 4 * _BLOCK:
        return _search(weights, u * weights.sum(dtype=np.float64))[0]
    starts = np.arange(0, len(weights), _BLOCK)
    sums = np.add.reduceat(weights, starts, dtype=np.float64)
    b, rest = _search(sums, u * sums.sum())
    return int(starts[b]) + _search(weights[starts[b] : starts[b] + _BLOCK], rest)[0]


def _search(weights: np.ndarray, target: float) -> tuple[int, float]:
    """The first i whose running sum passes `target` (the last nonzero one where rounding
    left `target` at the very end), and `target` less the sum before i. A zero weight is
    never the answer: its running sum equals the one before it."""
    ends = np.cumsum(weights, dtype=np.float64)
    i = int(np.searchsorted(ends, target, side="right"))
    if i == len(ends):
        i = int(np.flatnonzero(weights)[-1])
    return i, target - (ends[i - 1] if i else 0.0)


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        self._numpy_view: tuple[torch.Tensor, Any] | None = None
        self._scratch: np.ndarray | None = None

    def _default_generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        eos_ids: frozenset[int] = frozenset(),
    ) -> SamplerOutput:
        if all(r.plain for r in requests) and (view := self._cpu_view(logits)) is not None:
            # The common decode step in as few calls as possible: each one is cold after
            # the weights have streamed through the caches (NOTES section 34).
            if all(r.plain_greedy for r in requests):
                return SamplerOutput(view.argmax(axis=-1).tolist(), [None] * len(requests))
            tokens = [
                int(view[i].argmax())
                if r.plain_greedy
                else sample_row(view[i], r.sampling_params, self._uniform(r), self._weights(view))
                for i, r in enumerate(requests)
            ]
            return SamplerOutput(tokens, [None] * len(requests))
        params = [r.sampling_params for r in requests]
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw = logits
        if any(p.has_logits_processing or p.min_tokens for p in params):
            logits = logits.clone()
            process_logits(logits, requests, eos_ids)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if logits.device.type == "cpu":
            view = self._numpy(logits)
            token_list = (
                view.argmax(axis=-1).tolist()
                if len(random_rows) < len(params)
                else [0] * len(params)
            )
            for i in random_rows:
                token_list[i] = sample_row(
                    view[i], params[i], self._uniform(requests[i]), self._weights(view)
                )
            return SamplerOutput(token_list, self._logprobs(raw, params, token_list))
        tokens = logits.argmax(dim=-1)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = [requests[i] for i in random_rows]
            tokens[rows] = self._sample(logits[rows], chosen)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, params, token_list))

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
        through the caches a fresh `numpy()` costs ~70 us (NOTES section 30). Holds the
        last step's logits until the next step's arrive. numpy's argmax is vectorized;
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
        """A row-sized fp32 buffer for `sample_row`, kept across steps."""
        if self._scratch is None or self._scratch.shape[0] != view.shape[-1]:
            self._scratch = np.empty(view.shape[-1], dtype=np.float32)
        return self._scratch

    def _uniform(self, req: Request) -> float:
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
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logprobs = logits.log_softmax(dim=-1)
        top_n = max(n or 0 for n in wanted)
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
