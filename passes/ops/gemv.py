"""A small-batch linear layer as a multiply and a reduction over K with fp32 accumulation:
the form Inductor generates as one vectorized loop (see passes/gemv_to_reduction.py)."""

from __future__ import annotations

import torch


def gemv_reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T for small M."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1).to(x.dtype)


def gemv_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The LM head's small-batch GEMV, logits kept in fp32: the sampler works in fp32
    anyway, and rounding to bf16 first only makes near-ties between tokens exact ties."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1)
