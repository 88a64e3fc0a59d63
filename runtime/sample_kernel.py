"""A step's tokens on the device, one Triton program per row: greedy rows' argmax, the
others drawn from temperature, min-p, top-k and top-p, with counter-based randomness.

Captured with every full CUDA graph (issue 57: "temperature / top-k / top-p / min-p inside
the graph for the common case") and launched after the replay for every other CUDA step
(`Sampler._draw`), so a request's tokens do not depend on which path its step took. A
flag on the device says what the graph's launch does (`runtime.sampler.SAMPLE_*`): 0
nothing (the step's rows need the host sampler: logprobs, penalties, a grammar), 1 every
row greedy (no parameters read), 2 each row by its parameters (`Request.sample_row`).

Per row, on fp32 values y = logits / temperature, the same kept set as
`runtime.sampler.filter_logits`, found without sorting the vocabulary:

- min-p keeps exp(y - max y) >= min_p (the probability over the top one's);
- top-k keeps y >= the k-th largest value (ties too), found by a radix select over
  order-preserving integer keys: 8 passes of 4 bits, exact;
- top-p is sampled by rejection (as FlashInfer's sorting-free samplers): draw a candidate
  from what min-p and top-k keep, above a pivot; it is in the top-p set when the mass of
  the tokens above it is below top_p x the kept mass. Rejected, every token not above it
  is out too, so the next draw comes from above it, and a draw restricted to a superset
  of the top-p set, kept when inside, is a draw from the top-p set. A peaked row accepts
  its first candidate with probability >= top_p. Ties at top-p's edge are kept whole (a
  sort keeps an arbitrary part of them).

Each draw is one uniform u through the inverse CDF of the kept weights (a pass for their
mass, one for the running sum), u from Philox keyed by the request's seed at counter
(round, output position): a seeded request gives the same tokens whatever else is in the
batch and whichever path drew them. One uniform a draw, not one per token (a Gumbel race
over the vocabulary would run Philox's ten rounds on every logit).

A row with no distribution gets `runtime.cpu_sampling.degenerate_row_token`'s token: the
first +inf where there is one, NO_TOKEN for a nan or nothing above -inf.

Imported only where Triton runs (a CUDA device, or TRITON_INTERPRET=1 in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.cpu_sampling import NO_TOKEN

# Logits a loop trip (less for a small vocabulary). With 8 warps ptxas gives the sm_90
# build 80 registers and no spills (`ptxas -v`); 4 warps take 143, 16 spill.
BLOCK = 1024


@triton.jit
def _order_key(y):
    """An int64 in [0, 2**32) that orders as the fp32 values y do (none is nan), -0.0 and
    0.0 one key (equal values: top-k's ties, top-p's rejected candidate's equals)."""
    b = tl.where(y == 0.0, 0, y.to(tl.int32, bitcast=True))
    signed = b ^ ((b >> 31) & 0x7FFFFFFF)  # negatives: the magnitude bits reversed
    return signed.to(tl.int64) + 2147483648


@triton.jit
def _row_max(base, vocab, BLOCK: tl.constexpr):
    """The row's largest value, the first index holding it, and 1 where it has a nan."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK], tl.int32)
    nans = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        index = start + cols
        x = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
        nans = tl.maximum(nans, (x != x).to(tl.int32))
        better = x > best  # strictly: each lane keeps its first largest
        best = tl.where(better, x, best)
        where = tl.where(better, index, where)
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, where, vocab), axis=0), tl.max(nans, axis=0)


@triton.jit
def _kth_key(base, vocab, temperature, k, BLOCK: tl.constexpr):
    """The order key of the k-th largest y (1 <= k <= vocab): a radix select from the top
    4 bits down, each pass counting the tokens under the prefix found so far by digit."""
    cols = tl.arange(0, BLOCK)
    digits = tl.arange(0, 16)
    prefix = tl.zeros([], tl.int64)
    for shift in tl.static_range(28, -4, -4):
        at_least = tl.zeros([16], tl.int32)  # tokens under the prefix with digit >= i
        for start in range(0, vocab, BLOCK):
            index = start + cols
            x = tl.load(base + index, mask=index < vocab, other=0.0).to(tl.float32)
            key = _order_key(x / temperature)
            under = (index < vocab) & ((key >> (shift + 4)) == (prefix >> (shift + 4)))
            digit = (key >> shift) & 15
            hits = under[:, None] & (digit[:, None] >= digits[None, :])
            at_least += tl.sum(hits.to(tl.int32), axis=0)
        chosen = tl.max(tl.where(at_least >= k, digits, 0), axis=0)
        k -= tl.sum(tl.where(digits == chosen + 1, at_least, 0), axis=0)  # those above it
        prefix = prefix | (chosen.to(tl.int64) << shift)
    return prefix


@triton.jit
def _weights(base, index, vocab, temperature, y_top, min_p, kth_key, pivot_key):
    """A trip's weights exp(y - y_top): those of the tokens min-p and top-k keep whose
    key is above `pivot_key`, 0 for the others."""
    y = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
    y = y / temperature
    key = _order_key(y)
    weight = tl.exp(y - y_top)
    kept = (y > float("-inf")) & (weight >= min_p) & (key >= kth_key) & (key > pivot_key)
    return tl.where(kept, weight, 0.0)


@triton.jit
def _mass(base, vocab, temperature, y_top, min_p, kth_key, pivot_key, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        mass += _weights(base, start + cols, vocab, temperature, y_top, min_p, kth_key,
                         pivot_key)  # fmt: skip
    return tl.sum(mass, axis=0)


@triton.jit
def _pick(base, vocab, temperature, y_top, min_p, kth_key, pivot_key, target,
          BLOCK: tl.constexpr):  # fmt: skip
    """The first token where the running sum of the weights passes `target` (the inverse
    CDF; the last token with a weight where rounding leaves the target past the end),
    and its key."""
    cols = tl.arange(0, BLOCK)
    running = tl.zeros([], tl.float32)
    first = tl.full([], 2147483647, tl.int32)
    last = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        index = start + cols
        w = _weights(base, index, vocab, temperature, y_top, min_p, kth_key, pivot_key)
        passed = (tl.cumsum(w, axis=0) + running > target) & (w > 0.0)
        first = tl.minimum(first, tl.min(tl.where(passed, index, 2147483647), axis=0))
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, index, 0), axis=0))
        running += tl.sum(w, axis=0)
    token = tl.where(first < vocab, first, last)
    return token, _order_key(tl.load(base + token).to(tl.float32) / temperature)


@triton.jit
def _uniform(seed, position, trip):
    """A draw from [0, 1): Philox keyed by the request's seed at (trip, position)."""
    bits, _, _, _ = tl.philox(seed, trip, position, 0, 0)
    return tl.uint_to_uniform_float(bits)


@triton.jit
def _sample_kernel(logits_ptr, stride, vocab, flag_ptr, float_ptr, int_ptr, out_ptr,
                   NO_TOKEN_ID: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    mode = tl.load(flag_ptr)
    if mode == 0:
        return
    base = logits_ptr + row.to(tl.int64) * stride
    top, token, nan = _row_max(base, vocab, BLOCK)
    none = (nan > 0) | (top == float("-inf"))
    temperature = tl.load(float_ptr + row * 3, mask=mode == 2, other=0.0)  # greedy: 0
    # A sampled row with a distribution (a +inf wins whatever the draw: the first one).
    if (temperature > 0.0) & (top > float("-inf")) & (top < float("inf")) & (nan == 0):
        top_p = tl.load(float_ptr + row * 3 + 1)
        min_p = tl.load(float_ptr + row * 3 + 2)
        top_k = tl.load(int_ptr + row * 3)
        seed = tl.load(int_ptr + row * 3 + 1)
        position = tl.load(int_ptr + row * 3 + 2).to(tl.int32)
        y_top = top / temperature
        kth = tl.zeros([], tl.int64)  # every key is >= 0
        if (top_k > 0) & (top_k < vocab):
            kth = _kth_key(base, vocab, temperature, top_k.to(tl.int32), BLOCK)
        key = tl.full([], -1, tl.int64)  # below every key: no pivot yet
        mass = _mass(base, vocab, temperature, y_top, min_p, kth, key, BLOCK)
        target = _uniform(seed, position, 0) * mass
        token, key = _pick(base, vocab, temperature, y_top, min_p, kth, key, target, BLOCK)
        if top_p < 1.0:
            limit = top_p * mass
            above = _mass(base, vocab, temperature, y_top, min_p, kth, key, BLOCK)
            trip = tl.full([], 1, tl.int32)
            while above >= limit:  # the candidate is out, and every token not above it
                target = _uniform(seed, position, trip) * above
                token, key = _pick(base, vocab, temperature, y_top, min_p, kth, key, target,
                                   BLOCK)  # fmt: skip
                above = _mass(base, vocab, temperature, y_top, min_p, kth, key, BLOCK)
                trip += 1
    tl.store(out_ptr + row, tl.where(none, NO_TOKEN_ID, token).to(tl.int64))


def sample_tokens(
    logits: torch.Tensor,
    flag: torch.Tensor,
    float_params: torch.Tensor | None = None,
    int_params: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's token as int64 (module docstring). `flag`: int32 [1] on the logits'
    device (`SAMPLE_*`); `float_params` fp32 [rows, 3] and `int_params` int64 [rows, 3],
    each row a `Request.sample_row`, read only under SAMPLE_PARAMS. `out`: int64 [rows]
    to write into (else a new tensor); not written under SAMPLE_OFF. One launch, nothing
    read back (capturable)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and flag.dtype == torch.int32, (logits.stride(), flag.dtype)
    if float_params is None or int_params is None:  # greedy only: never read
        float_params = int_params = flag
    else:
        assert float_params.dtype == torch.float32 and int_params.dtype == torch.int64
        assert float_params.is_contiguous() and int_params.is_contiguous()
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _sample_kernel[(rows,)](logits, logits.stride(0), vocab, flag, float_params, int_params,
                            out, NO_TOKEN_ID=NO_TOKEN, BLOCK=block, num_warps=8)  # fmt: skip
    return out
