"""The quantized products on CUDA: `q4_linear` and `q8_linear` (formats and reference in
`quantized.py`) as one Triton kernel that reads the blocks and dequantizes each tile in
registers, so a decode step streams the blocks' bytes instead of a dequantized copy.

Unfused (what Inductor would run from the traced pair): a kernel writes the whole weight
dequantized, then a GEMM reads it again (on a GPU, 2 bytes a value written and read where
the blocks hold 0.56-1.06). Fused: one kernel, tiles of [BLOCK_M, BLOCK_N] outputs, K in
runs of 32 values, `tl.dot` on values rounded as the reference rounds them, fp32 sums.
Tested on CPU under TRITON_INTERPRET=1. Timed on an H200 (NOTES 52): at its best tile
0.53-0.74x Inductor's dequantization + cuBLAS, so the pass stays off on CUDA.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from passes.ops.quantized import GROUPS_PER_SUPER, groups_of

_TL_DTYPES = ("float32", "bfloat16", "float16")


class Tile(NamedTuple):
    """A launch's shape: outputs [block_m, block_n] a program, K in steps of block_k."""

    block_m: int
    block_n: int
    block_k: int = 32
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default


def default_tile(m: int) -> Tile:
    # Up to 16 rows: the fastest of seven tiles timed on an H200 (NOTES 52: 3.5x the first
    # choice, [16, 64] in steps of 32; many programs with long K steps win). Larger: untimed.
    return Tile(16, 8, 256, 2) if m <= 16 else Tile(32, 64)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    name = str(dtype).removeprefix("torch.")
    if name not in _TL_DTYPES:
        raise TypeError(f"quantized products take float32, bfloat16 or float16, not {dtype}")
    return getattr(tl, name)


def quant_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    fields: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ dequantize(w, *fields)^T (+ bias): q4 when `fields` is (scales,
    mins), q8 when it is (scales,). `tile`: the launch's shape (`default_tile(M)`)."""
    from passes.ops.triton_quant_kernels import quant_linear_kernel

    bits = 4 if len(fields) == 2 else 8
    x = x if x.stride(-1) == 1 else x.contiguous()
    fields = tuple(f.contiguous() for f in fields)
    m, k = x.shape
    n = w.shape[0]
    out_dtype = out_dtype or x.dtype
    y = x.new_empty(m, n, dtype=out_dtype)
    if m == 0 or n == 0:
        return y
    if k % 32:
        raise ValueError(f"quantized products take K in runs of 32 values, got K={k}")
    value = torch.promote_types(x.dtype, out_dtype)
    # Triton's interpreter multiplies 16-bit operands as their raw bits: fp32 there.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    dot = torch.float32 if value == torch.float32 or interpreted else value
    tile = tile or default_tile(m)
    if tile.block_k % 32:
        raise ValueError(f"block_k must be a multiple of 32 (the formats' runs), got {tile}")
    grid = (-(-m // tile.block_m), -(-n // tile.block_n))
    extra = {} if tile.num_stages is None else {"num_stages": tile.num_stages}
    scales, mins = fields[0], fields[-1]
    quant_linear_kernel[grid](
        x, w.contiguous(), scales, mins, bias if bias is not None else y, y,
        m, n, k, groups_of(scales), x.stride(0), y.stride(0),
        BITS=bits,
        PER_SUPER=GROUPS_PER_SUPER.get(scales.dtype, 0),  # compact fields: Q4_K's, Q6_K's
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        VALUE_DTYPE=_tl_dtype(value),
        DOT_DTYPE=_tl_dtype(dot),
        # fp32 models want fp32 answers: TF32 would cost three decimal digits.
        PRECISION="ieee" if dot == torch.float32 else "tf32",
        num_warps=tile.num_warps,
        **extra,
    )  # fmt: skip
    return y
