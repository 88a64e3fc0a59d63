"""The Triton kernel of `gemv_partials` (imported only where Triton is usable)."""

import triton
import triton.language as tl


# M and the split's length vary with the piece, not the step: a static-size piece has one
# M, so specializing on them costs no compile mid-serving.
@triton.jit
def gemv_partials_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    PER_SPLIT,
    x_stride,
    w_stride,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: BLOCK_N outputs of every row, over one split of K (PER_SPLIT values,
    # whole BLOCK_K tiles), each weight tile read once for all ROWS rows of x.
    block = tl.program_id(0)
    split = tl.program_id(1)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    n_mask, r_mask = n < N, r < M
    start = split * PER_SPLIT
    end = tl.minimum(start + PER_SPLIT, K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(start, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < end
        w = tl.load(
            w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.load(
            x_ptr + r[:, None] * x_stride + k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    dst = out_ptr + (split * M + r[:, None]).to(tl.int64) * N + n[None, :]
    tl.store(dst, acc, mask=r_mask[:, None] & n_mask[None, :])
