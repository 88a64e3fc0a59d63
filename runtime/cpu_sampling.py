"""Sampling on CPU: the filters of `runtime.sampler` (temperature, min-p, top-k, top-p in
vLLM's order) without sorting the vocabulary, the draw by the inverse CDF of one uniform
per row, and a row's logprobs and ranks.

`sample_rows` runs a batch's rows in C (cpu_sampling.cpp, in parallel) and falls back to
`sample_row`, the same steps a row at a time in numpy, where the kernel cannot be built. Why not
torch: at batch 1 a whole-row sort (top-k / top-p) took ~3.6 ms and the exponential race's noise
~1 ms on a 49k vocabulary, against a ~7-9 ms decode step; each torch or numpy call also runs
cold after the weights have streamed through the caches (docs/kernel-choices.md, Host time).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import weakref
from pathlib import Path

import numpy as np

from passes import native
from runtime.sampling_params import SamplingParams


def build() -> bool:
    """Builds (or loads) the C kernel; whether this machine has it."""
    return _kernel() is not None


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    return native.load_op_kernel(Path(__file__).with_suffix(".cpp"), "sample_rows_available",
                                 (), ("sample_rows(ptr, i64 x3, f64*, i64*)",))  # fmt: skip


class _Buffers(threading.local):
    """The kernel's argument buffers for each batch size and the address of the logits it
    saw last (a weak reference: an engine's logits are not kept alive here), kept across steps,
    per thread (a call releases the GIL, and two engines may step on two threads). Cold after
    the weight stream, a fresh numpy spec array, an output array and three `.ctypes.data` took
    ~85 us a batch-1 step, as long as the kernel itself (docs/kernel-choices.md, Host time)."""

    def __init__(self):
        self.by_rows: dict[int, tuple[ctypes.Array, ctypes.Array]] = {}
        self.logits: weakref.ref | None = None
        self.address = 0

    def get(self, rows: int) -> tuple[ctypes.Array, ctypes.Array]:
        if (found := self.by_rows.get(rows)) is None:
            found = self.by_rows[rows] = (ctypes.c_double * (6 * rows))(), (ctypes.c_int64 * rows)()
        return found

    def pointer(self, logits: np.ndarray) -> int:
        # A CPU graph hands back the same array every step.
        if self.logits is None or self.logits() is not logits:
            self.logits, self.address = weakref.ref(logits), logits.ctypes.data
        return self.address


_buffers = _Buffers()

# The token of a row that has nothing to draw: its request finishes with finish_reason
# "error" (runtime/engine.py). cpu_sampling.cpp's kNoToken.
NO_TOKEN = -1


def sample_rows(
    logits: np.ndarray,
    rows: list[tuple[int, SamplingParams, float]],
    out: np.ndarray | None = None,
    kernel: bool = True,
) -> list[int]:
    """A token for each (row of `logits` [*, vocab] fp32, its params, a uniform draw in
    [0, 1)), in C where the kernel builds (and `kernel`), else `sample_row` per row
    (`out`: its weights buffer)."""
    lib = _kernel() if kernel else None
    if lib is None or logits.strides[1] != 4:
        return [sample_row(logits[i], p, u, out) for i, p, u in rows]
    n = len(rows)
    spec, tokens = _buffers.get(n)
    for j, (i, p, u) in enumerate(rows):
        top_k = p.top_k if p.uses_top_k else 0
        spec[6 * j : 6 * j + 6] = (i, 1.0 / p.temperature, p.min_p, top_k, p.top_p, u)
    stride, vocab = logits.strides[0] // 4, logits.shape[1]
    lib.sample_rows(_buffers.pointer(logits), stride, vocab, n, spec, tokens)
    return tokens[:n]


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
    if not np.isfinite(top):  # no distribution to draw from
        return degenerate_row_token(logits)
    ids, weights = kept_weights(logits, params, out)
    token = _draw(weights, u)
    return token if ids is None else int(ids[token])


def degenerate_row_token(logits: np.ndarray) -> int:
    """The token of a row whose largest logit is not finite, as every sampler path
    gives it: NO_TOKEN for a nan anywhere (the model broke) or every logit -inf (the
    request's own filters masked every token), else the first +inf (the limit of its
    distribution)."""
    if np.isnan(logits).any():
        return NO_TOKEN
    top = np.flatnonzero(logits == np.inf)
    return int(top[0]) if len(top) else NO_TOKEN


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


def row_logprobs(
    logits: np.ndarray, token: int, n: int, out: np.ndarray | None = None
) -> dict[int, tuple[float, int]]:
    """{token id: (logprob, rank)} for `token` and the `n` most likely tokens of a row of
    fp32 logits (rank 1 = most likely; a token's rank is 1 + the tokens above it)."""
    top = logits.max()
    weights = np.subtract(logits, top, out=np.empty_like(logits) if out is None else out)
    np.exp(weights, out=weights)
    log_total = float(top) + math.log(weights.sum(dtype=np.float64))
    value = logits[token]
    entry = {token: (float(value) - log_total, int(np.count_nonzero(logits > value)) + 1)}
    if n:
        ids = _candidates(weights, n, 0.0)
        if len(ids) > n:
            ids = ids[np.argpartition(-logits[ids], n - 1)[:n]]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        entry.update({t: (float(logits[t]) - log_total, r + 1) for r, t in enumerate(ids.tolist())})
    return entry
