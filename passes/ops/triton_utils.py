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


def row_num_warps(block: int) -> int:
    """Warps for a kernel that handles one row of `block` elements per program: a warp
    per 512 elements (16 per thread), 1 to 16. One warp for a 4096-wide norm left most
    of an SM's lanes idle; 32 for a 128-wide row would mostly mask lanes off."""
    return max(1, min(16, block // 512))
