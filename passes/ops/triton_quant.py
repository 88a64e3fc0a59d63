"""The quantized products on CUDA: `q4_linear` and `q8_linear` (formats and reference in
`quantized.py`) as one Triton kernel that reads the blocks and dequantizes each tile in
registers, so a decode step streams the blocks' bytes instead of a dequantized copy.

Unfused (what Inductor would run from the traced pair): a kernel writes the whole weight
dequantized, then a GEMM reads it again (on a GPU, 2 bytes a value written and read where the
blocks hold 0.56-1.06). Fused: one kernel, programs of [BLOCK_M, BLOCK_N] outputs, K in steps of
BLOCK_K (optionally split over SPLIT_K programs whose fp32 partials are summed after), each
step's weight bytes one contiguous load a row (q4's two nibbles of a byte are the step's two
halves), a group's scale loaded once and broadcast; fp32 multiply-adds for one row, `tl.dot` for
more, on values rounded as the reference rounds them, fp32 sums. Tested on CPU under
TRITON_INTERPRET=1. The first version gathered one byte address a value and one scale a value:
on an H200 at its best tile 0.53-0.74x Inductor's dequantization + cuBLAS, so the pass stays off
on CUDA until `gpu_check`'s `quantized_products` times this one (not yet run on a device;
docs/kernel-choices.md, Quantized products on CUDA).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from passes.ops.quant_layout import GROUPS_PER_SUPER, groups_of, is_iq4, is_q5

_TL_DTYPES = ("float32", "bfloat16", "float16")


class Tile(NamedTuple):
    """A launch's shape: outputs [block_m, block_n] a program, K in steps of block_k."""

    block_m: int
    block_n: int
    block_k: int = 32
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default
    split_k: int = 1  # programs along K, each summing its share into fp32 partials


def default_tile(m: int) -> Tile:
    # Untimed on a device: `gpu_check`'s `quantized_products` sweep decides.
    if m == 1:
        return Tile(1, 16, 512, 4)
    return Tile(16, 16, 256, 4) if m <= 16 else Tile(32, 64, 64)


# Batch-invariant mode's tile: one shape (tl.dot, no split-K) for every row count, so a
# row's sums never depend on the batch (tests/test_batch_invariant.py).
INVARIANT_TILE = Tile(16, 16, 256, 4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    from passes.ops.triton_quant_kernels import quant_stream_kernel

    bits = 4 if len(fields) == 2 else 8
    if bits == 8 and is_iq4(w, fields[0]):
        raise ValueError(
            "IQ4's 4-bit table indices are the CPU's layout: off the CPU a GGUF file's IQ4_NL "
            "and IQ4_XS blocks are dequantized when loaded (models/gguf.py `_kept_formats`)"
        )
    if bits == 8 and w.dtype == torch.uint8:
        raise ValueError(
            "Q6_K's 6-bit rows (the CPU's layout): the Triton product reads int8 values, "
            "unpacked once at load (models/layers/quantization.py `unpack_6bit_values`)"
        )
    if bits == 4 and is_q5(w, fields[0]):
        raise ValueError(
            "Q5_K's 5-bit rows are the CPU's layout: off the CPU a GGUF file's Q5_K blocks "
            "are dequantized when loaded (models/gguf.py `keeps_q5_k`)"
        )
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
    if tile.block_k % 32 or tile.block_k & (tile.block_k - 1):
        raise ValueError(f"block_k must be a power of 2 from 32 (the formats' runs), got {tile}")
    scales, mins = fields[0], fields[-1]
    groups = groups_of(scales)
    per_group = (k // groups) // (2 if bits == 4 else 1)  # a group's share of a half step
    run = tile.block_k // 2 if groups == 1 else math.gcd(per_group, tile.block_k // 2)
    k_chunk = _cdiv(_cdiv(k, tile.split_k), tile.block_k) * tile.block_k
    split = _cdiv(k, k_chunk)
    grid = (_cdiv(m, tile.block_m), _cdiv(n, tile.block_n), split)
    part = y if split == 1 else x.new_empty(split, m, n, dtype=torch.float32)
    extra = {} if tile.num_stages is None else {"num_stages": tile.num_stages}
    quant_stream_kernel[grid](
        x, w.contiguous(), scales, mins, bias if bias is not None else y, part,
        m, n, k, groups, k // groups, x.stride(0), y.stride(0), k_chunk,
        BITS=bits,
        PER_SUPER=GROUPS_PER_SUPER.get(scales.dtype, 0),  # compact fields: Q4_K's, Q6_K's
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        RUN=run,
        SPLIT_K=split,
        VALUE_DTYPE=_tl_dtype(value),
        DOT_DTYPE=_tl_dtype(dot),
        # fp32 models want fp32 answers: TF32 would cost three decimal digits.
        PRECISION="ieee" if dot == torch.float32 else "tf32",
        num_warps=tile.num_warps,
        **extra,
    )  # fmt: skip
    if split > 1:
        total = part.sum(0)
        y.copy_(total if bias is None else total + bias.float())
    return y
