"""The Triton kernel of the quantized products (`triton_quant.py`; formats in
`quantized.py`), at module level: imported only where Triton is used (see
`triton_fused.py` for why kernels are not defined inside functions)."""

import triton
import triton.language as tl


@triton.jit
def _group_field(f_ptr, rows, groups, mask, GROUPS, PER_SUPER: tl.constexpr):
    """A scales (or mins) field's value for each (row, group) of a tile, fp32. Compact
    (PER_SUPER > 0: the K-quants' as stored): per row GROUPS sub-block bytes (Q4_K's
    unsigned, Q6_K's int8: the pointer's type), then one fp32 super-block scale per
    PER_SUPER groups as 4 bytes, multiplied here exactly as `expand_compact` does."""
    if PER_SUPER > 0:
        row_bytes = GROUPS + GROUPS // PER_SUPER * 4
        base = f_ptr + rows[:, None] * row_bytes
        sub = tl.load(base + groups, mask=mask, other=0).to(tl.float32)
        at = base + GROUPS + (groups // PER_SUPER) * 4
        word = tl.load(at, mask=mask, other=0).to(tl.int32) & 255
        word |= (tl.load(at + 1, mask=mask, other=0).to(tl.int32) & 255) << 8
        word |= (tl.load(at + 2, mask=mask, other=0).to(tl.int32) & 255) << 16
        word |= (tl.load(at + 3, mask=mask, other=0).to(tl.int32) & 255) << 24
        return sub * word.to(tl.float32, bitcast=True)
    return tl.load(f_ptr + rows[:, None] * GROUPS + groups, mask=mask, other=0).to(tl.float32)


@triton.jit
def quant_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUPS,
    x_stride,
    y_stride,
    BITS: tl.constexpr,
    PER_SUPER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VALUE_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y [M, N] = x [M, K] @ dequantize(w)^T (+ bias), one [BLOCK_M, BLOCK_N] tile a
    program, K in steps of BLOCK_K (a multiple of the formats' runs of 32 values). Each
    weight value is dequantized in fp32 and rounded to VALUE_DTYPE, as the reference
    rounds its dequantized copy; the dot sums in fp32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rows_m < M, rows_n < N
    kk = tl.arange(0, BLOCK_K)
    group_size = K // GROUPS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + kk
        k_mask = (cols < K)[None, :]
        x = tl.load(x_ptr + rows_m[:, None] * x_stride + cols[None, :],
                    mask=m_mask[:, None] & k_mask, other=0.0)  # fmt: skip
        groups = (cols // group_size)[None, :]
        w_mask = n_mask[:, None] & k_mask
        if BITS == 4:  # byte j of a run of 32 holds value j (low nibble) and j + 16 (high)
            within = kk % 32
            byte_at = (k0 + kk - within) // 2 + within % 16
            at = w_ptr + rows_n[:, None] * (K // 2) + byte_at[None, :]
            byte = tl.load(at, mask=w_mask, other=0).to(tl.int32)
            q = ((byte >> ((within // 16) * 4)[None, :]) & 15).to(tl.float32)
            w = q * _group_field(s_ptr, rows_n, groups, w_mask, GROUPS, PER_SUPER)
            w += _group_field(m_ptr, rows_n, groups, w_mask, GROUPS, PER_SUPER)
        else:
            at = w_ptr + rows_n[:, None] * K + cols[None, :]
            q = tl.load(at, mask=w_mask, other=0).to(tl.float32)
            w = q * _group_field(s_ptr, rows_n, groups, w_mask, GROUPS, PER_SUPER)
        w = w.to(VALUE_DTYPE).to(DOT_DTYPE)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows_m[:, None] * y_stride + rows_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
