"""`gemv_partials(x, w, splits) -> [splits, M, N] fp32`: a small-batch product split
along K, each split's sum kept apart; the split-K GEMV of `passes/splitk_gemv.py`.

At batch 1 a linear layer reads its weight once; a library GEMV of a small projection
(the 1B model's QKV 3072 x 2048, o 2048 x 2048) ran at half the read rate of the large
ones on an H200 (issue 57: ~1.6-2.0 against ~3.7 TB/s), as too few programs stream it.
Splitting K gives each output block `splits` programs. Their partial sums are this op's
output, and the sum over splits is left to the graph: Inductor fuses it into the consumer
(the residual add and norm, the activation, RoPE), so there is no second launch and no
atomics, and the order of the sum is fixed (the same bits every run).

CUDA: one Triton kernel (`_kernel`), programs of BLOCK_N outputs x one split, all M <=
MAX_ROWS rows at once, fp32 multiply-adds. Elsewhere: the reference (the same splits'
partial sums in torch), so the op means the same on every device; tested against it
under TRITON_INTERPRET=1 (tests/test_splitk_gemv.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from passes.ops.triton_utils import next_power_of_2, use_triton

MAX_ROWS = 4


class GemvTile(NamedTuple):
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4


# Untimed on a device: benchmarks/gpu_check.py's `splitk_gemv` step sweeps tiles.
DEFAULT_TILE = GemvTile()
# Programs a launch should have to keep every SM streaming (an H100/H200 has 132 SMs).
TARGET_PROGRAMS = 512


def choose_splits(n: int, k: int, block_n: int = DEFAULT_TILE.block_n) -> int:
    """Splits along K so that the launch has about TARGET_PROGRAMS programs, each split
    at least 512 values of K (fewer would spend the program on its start)."""
    blocks = -(-n // block_n)
    return max(1, min(-(-TARGET_PROGRAMS // blocks), k // 512, 16))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_bounds(k: int, splits: int, block_k: int) -> list[tuple[int, int]]:
    """Each split's [start, end) of K: whole tiles of block_k, the last one shorter."""
    per = _cdiv(_cdiv(k, splits), block_k) * block_k
    return [(min(s * per, k), min((s + 1) * per, k)) for s in range(splits)]


def gemv_partials_ref(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """The reference: split s holds x[:, K_s] @ w[:, K_s]^T in fp32."""
    bounds = split_bounds(x.shape[1], splits, DEFAULT_TILE.block_k)
    xf, wf = x.float(), w.float()
    return torch.stack([xf[:, a:b] @ wf[:, a:b].t() for a, b in bounds])


def gemv_partials_triton(
    x: torch.Tensor, w: torch.Tensor, splits: int, tile: GemvTile = DEFAULT_TILE
) -> torch.Tensor:
    from passes.ops.gemv_partials_kernel import gemv_partials_kernel

    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"gemv_partials serves at most {MAX_ROWS} rows, got {m}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    per = split_bounds(k, splits, tile.block_k)[0][1]
    grid = (-(-n // tile.block_n), splits)
    gemv_partials_kernel[grid](
        x, w, out, m, n, k, per, x.stride(0), w.stride(0),
        ROWS=next_power_of_2(m), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
    )  # fmt: skip
    return out


def gemv_partials(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    if use_triton(x) and x.shape[0] <= MAX_ROWS:
        return gemv_partials_triton(x, w, splits)
    return gemv_partials_ref(x, w, splits)


def _fake(x, w, splits):
    return x.new_empty(splits, x.shape[0], w.shape[0], dtype=torch.float32)


_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("gemv_partials(Tensor x, Tensor w, int splits) -> Tensor")
_LIB.impl("gemv_partials", gemv_partials, "CompositeExplicitAutograd")
torch.library.register_fake("compilecore::gemv_partials", _fake, lib=_LIB)
