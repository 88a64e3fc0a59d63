"""`invariant_mm(a, b) -> a @ b` whose every row is the same whatever the other rows are
and however many there are: the product of batch-invariant mode (`passes/batch_invariant.py`).

A library GEMM picks its kernel by the row count: on the EPYC Zen 3 of 2026-12-05 MKL's
fp32 GEMM gives other bits for 1-3 rows, and for the last row of 5-7 and 9-11 rows, than
for the same row among 16 (tests/test_batch_invariant.py measures it); on an AMX Xeon
(2026-12-06) oneDNN's bf16 GEMM and MKL's fp32 one gave 16 rows other bits than the same
rows among 48, one call over whole tiles. So every call takes exactly `ROWS` rows (zero
rows appended, one call a tile): each row is computed by the same kernel whatever the
batch; the zero rows cost nothing at decode, where the weight's bytes bound the time.
On CUDA (cuBLAS picks its kernel, and split-K, by the shape) the op is our own Triton
kernel with one tile shape for every row count (`invariant_mm_kernel.py`).
"""

from __future__ import annotations

import torch

from passes import native_calls
from passes.ops import onednn_shim
from passes.ops.triton_utils import HAS_TRITON

ROWS = 16


# Batch-invariant mode's long steps (prefill chunks: `quantized.q4_linear`) call it on
# tiles this tall: each tile reads the weight once, and 16-row tiles read a 1024-row
# prefill's weights 64 times.
LONG_ROWS = 64


def padded_rows(m: int, tile: int = ROWS) -> int:
    return max(tile, -(-m // tile) * tile)


def invariant_mm(a: torch.Tensor, b: torch.Tensor, tile: int = ROWS) -> torch.Tensor:
    m, rows = a.shape[0], padded_rows(a.shape[0], tile)
    full = a.new_zeros(rows, a.shape[1])
    full[:m] = a  # contiguous whatever a's strides: one layout, one kernel
    out = a.new_empty(rows, b.shape[1])
    for i in range(0, rows, tile):
        torch.mm(full[i : i + tile], b, out=out[i : i + tile])
    return out[:m]


# Row counts the start-up check compares with a full tile: short, odd and past one tile.
CHECKED_ROWS = (1, 2, 3, 5, 7, 11, 16, 17, 31)


class NotBatchInvariant(RuntimeError):
    """This machine's GEMM gives a row other bits beside other rows, even one tile a call."""


def check_rows(
    k: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu", tile: int = ROWS
) -> None:
    """Fail closed: `invariant_mm` (tiles of `tile` rows) of m rows, for each m in
    CHECKED_ROWS and past a tile, at offsets 0 and 5, must give exactly the bits those
    rows get among 3 tiles' rows (a library whose kernel for a whole tile still depends on
    the row count or a row's place, or a build that changed it, would make batch-invariant
    mode quietly variant). Raises NotBatchInvariant naming the shape."""
    g = torch.Generator(device=device).manual_seed(k * 31 + n)
    total = 3 * tile
    a = torch.randn(total, k, generator=g, device=device).to(dtype)
    b = torch.randn(k, n, generator=g, device=device).to(dtype)
    full = invariant_mm(a, b, tile)
    for start in (0, 5):
        for m in (*CHECKED_ROWS, tile + 1, 2 * tile - 1):
            got = invariant_mm(a[start : start + m], b, tile)
            if not torch.equal(got, full[start : start + m]):
                raise NotBatchInvariant(
                    f"batch_invariant: {m} rows of a [{k} x {n}] {dtype} product get other "
                    f"bits than the same rows among {total}, even called a tile of {tile} rows "
                    "at a time: this machine's GEMM cannot keep batch invariance (run "
                    "without batch_invariant)"
                )


# The Triton kernel's tile: fixed, whatever the rows (16: tl.dot's smallest).
TRITON_TILE = (16, 64, 64)


def invariant_mm_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b by the Triton kernel (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
    import os

    from passes.ops.invariant_mm_kernel import invariant_mm_kernel

    (m, k), n = a.shape, b.shape[1]
    out = a.new_empty(m, n)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = TRITON_TILE
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (-(-m // block_m), -(-n // block_n))
    invariant_mm_kernel[grid](
        a, b, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_F32=interpreted and a.dtype != torch.float32,
        # fp32 models want fp32 answers: TF32 would cost three decimal digits.
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def _fake_invariant_mm(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


def _native_call(args: tuple, out: torch.Tensor) -> native_calls.NativeCall | tuple:
    """The op's tiles as a C call for a CPU graph: the same library GEMM, one tile a call,
    through AOTInductor's shim (the op itself calls it through torch)."""
    a, b = args
    if not a.shape[0]:
        return ()
    if not a.is_contiguous() or out.stride() != (b.shape[1], 1):
        raise native_calls.Unrecordable("compilecore.invariant_mm on strided rows")
    call = onednn_shim.tiles_mm_call(a, b, out, padded_rows(a.shape[0]), ROWS)
    if call is None:
        raise native_calls.Unrecordable("compilecore.invariant_mm (no AOTInductor shim)")
    return call


_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("invariant_mm(Tensor a, Tensor b) -> Tensor")
_LIB.impl("invariant_mm", invariant_mm, "CompositeExplicitAutograd")
if HAS_TRITON:  # else the library GEMM's tiles (check_rows decides at start)
    _LIB.impl("invariant_mm", invariant_mm_triton, "CUDA")
torch.library.register_fake("compilecore::invariant_mm", _fake_invariant_mm, lib=_LIB)
native_calls.declare_entry("compilecore::invariant_mm", _native_call)
# The op, as callers outside a compiled graph use it: a CPU graph records the op's declared
# call (the Python function above it cannot be recorded).
invariant_mm_op = torch.ops.compilecore.invariant_mm
