"""`invariant_mm(a, b) -> a @ b` whose every row is the same whatever the other rows are
and however many there are: the product of batch-invariant mode (`passes/batch_invariant.py`).

A library GEMM picks its kernel by the row count: on the EPYC Zen 3 of 2026-12-05 MKL's
fp32 GEMM gives other bits for 1-3 rows, and for the last row of 5-7 and 9-11 rows, than
for the same row among 16 (tests/test_batch_invariant.py measures it). Calling it only
with whole tiles of `ROWS` rows (zero rows appended) keeps every row on the path a full
tile takes; the zero rows cost nothing at decode, where the weight's bytes bound the time.
"""

from __future__ import annotations

import torch

ROWS = 16


def padded_rows(m: int) -> int:
    return max(ROWS, -(-m // ROWS) * ROWS)


def invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a.shape[0]
    full = a.new_zeros(padded_rows(m), a.shape[1])
    full[:m] = a  # contiguous whatever a's strides: one layout, one kernel
    return torch.mm(full, b)[:m]


def _fake_invariant_mm(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("invariant_mm(Tensor a, Tensor b) -> Tensor")
_LIB.impl("invariant_mm", invariant_mm, "CompositeExplicitAutograd")
torch.library.register_fake("compilecore::invariant_mm", _fake_invariant_mm, lib=_LIB)
