"""The Triton kernel of `invariant_mm` on CUDA (`invariant_mm.py`), at module level:
imported only where Triton is used (see `triton_fused.py` for why kernels are not defined
inside functions).

One program computes a [BLOCK_M, BLOCK_N] tile of the output, walking K in BLOCK_K steps
in order with an fp32 accumulator: a row's outputs are made by the same instructions in
the same order whatever the other rows of its tile hold and however many tiles there are
(no split-K, no autotuned tile that changes with the row count), which is what a library
GEMM does not promise (tests/test_batch_invariant.py).
"""

import triton
import triton.language as tl


@triton.jit
def invariant_mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                        stride_bn, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                        PRECISION: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0)  # fmt: skip
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0)  # fmt: skip
        if DOT_F32:  # the interpreter multiplies 16-bit operands as their raw bits
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], c,
             mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip
