"""The compact scale fields of the K-quants (passes/ops/quantized.py describes the
formats): what both the CPU ops and the CUDA kernel's launcher (`triton_quant.py`) read
to size a row, kept apart so neither imports the other."""

from __future__ import annotations

from types import MappingProxyType

import torch

# Compact fields by dtype: groups a super-block (whose fp32 scale follows the row's bytes).
GROUPS_PER_SUPER = MappingProxyType({torch.uint8: 8, torch.int8: 16})  # Q4_K's, Q6_K's


def is_compact(field: torch.Tensor) -> bool:
    return field.dtype in GROUPS_PER_SUPER


def groups_of(scales: torch.Tensor) -> int:
    """Groups a row of this scales field covers (compact: G bytes, then G/8 or G/16 fp32)."""
    if not is_compact(scales):
        return scales.shape[-1]
    per = GROUPS_PER_SUPER[scales.dtype]
    return scales.shape[-1] * per // (per + 4)
