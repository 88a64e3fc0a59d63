"""A small-batch linear layer as a multiply and a reduction over K with fp32 accumulation:
the form Inductor generates as one vectorized loop (see passes/gemv_to_reduction.py)."""

from __future__ import annotations

import functools

import torch


def gemv_reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T for small M."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1).to(x.dtype)


@functools.cache
def compiled_gemv():
    # One compiled loop per (M, N, K, dtype): few shapes ever reach it (logits at batch <= 4).
    return torch.compile(gemv_reduction, dynamic=False, fullgraph=True)
