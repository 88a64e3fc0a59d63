"""When to use the Triton kernels: CUDA tensors, or any tensor under TRITON_INTERPRET=1
when a test asks for it explicitly."""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    forced = os.environ.get("COMPILECORE_FUSED_OPS", "")
    if forced == "torch":
        return False
    return t.is_cuda or (forced == "triton" and os.environ.get("TRITON_INTERPRET") == "1")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
