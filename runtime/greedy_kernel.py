"""Greedy tokens inside a full CUDA graph: one Triton pass over each row of logits.

The sampler's greedy rule (runtime/sampler.py: the argmax, then `_degenerate_rows`) takes
six kernels over the logits after the graph: the argmax, a nan test, a test for any value
above -inf, one for +inf, a select and a fill. Captured with the step instead, the tokens
of an all-greedy step are on the device when the replay ends, in one launch-free pass
(issue 57: "the greedy argmax and the NaN/inf check run inside the full graph"). A step
that samples any other way leaves the flag at 0: each program returns at once.

Imported only where Triton runs (a CUDA device, or TRITON_INTERPRET=1 in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.cpu_sampling import NO_TOKEN

BLOCK = 2048  # logits a loop trip: 8 KB of fp32 per program in flight


@triton.jit
def _greedy_kernel(logits_ptr, stride, vocab, flag_ptr, out_ptr, NO_TOKEN_ID: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    if tl.load(flag_ptr) == 0:
        return
    base = logits_ptr + row.to(tl.int64) * stride
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
    first = tl.min(tl.where(best == top, where, vocab), axis=0)
    # No distribution (a nan, or nothing above -inf): the sampler's degenerate rule.
    none = (tl.max(nans, axis=0) > 0) | (top == float("-inf"))
    tl.store(out_ptr + row, tl.where(none, NO_TOKEN_ID, first).to(tl.int64))


def greedy_tokens(
    logits: torch.Tensor, flag: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's first largest logit as int64, or NO_TOKEN where the row has a nan or
    nothing above -inf: what `Sampler._draw` gives greedy rows. `flag` (int32 [1], on the
    logits' device) holds 0 where the step samples otherwise; the tokens are then not
    written. `out`: int64 [rows] to write them into (else a new tensor). Launches one
    kernel and reads nothing back (capturable)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and flag.dtype == torch.int32, (logits.stride(), flag.dtype)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _greedy_kernel[(rows,)](logits, logits.stride(0), vocab, flag, out, NO_TOKEN_ID=NO_TOKEN,
                            BLOCK=BLOCK, num_warps=8)  # fmt: skip
    return out
