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
def _half_step(w_ptr, s_ptr, m_ptr, rows_n, n_mask, k0, K, GROUPS, GS,
               HALF_INDEX: tl.constexpr, BITS: tl.constexpr, PER_SUPER: tl.constexpr,
               BLOCK_N: tl.constexpr, HALF: tl.constexpr, RUN: tl.constexpr,
               VALUE_DTYPE: tl.constexpr):  # fmt: skip
    """Half a K step's weights, dequantized: [BLOCK_N, HALF] values (rounded to
    VALUE_DTYPE, returned in fp32) and the HALF columns of x they multiply. Each row's
    bytes are one contiguous load: q4's low nibbles are the half 0 (columns j of each run
    of 32), its high ones the half 1 (j + 16); q8's halves are the step's two halves.
    The group fields are loaded once per RUN values and broadcast (RUN divides a group's
    share of the half, or the half lies in one group)."""
    j = tl.arange(0, HALF)
    sub = tl.arange(0, HALF // RUN)
    if BITS == 4:
        cols = k0 + (j // 16) * 32 + j % 16 + 16 * HALF_INDEX
        at = w_ptr + rows_n[:, None] * (K // 2) + (k0 // 2 + j)[None, :]
        mask = n_mask[:, None] & (cols < K)[None, :]
        byte = tl.load(at, mask=mask, other=0).to(tl.int32)
        q = ((byte >> (4 * HALF_INDEX)) & 15).to(tl.float32)
        groups = (k0 + 2 * RUN * sub) // GS
    else:
        cols = k0 + HALF * HALF_INDEX + j
        mask = n_mask[:, None] & (cols < K)[None, :]
        q = tl.load(w_ptr + rows_n[:, None] * K + cols[None, :], mask=mask, other=0)
        q = q.to(tl.float32)
        groups = (k0 + HALF * HALF_INDEX + RUN * sub) // GS
    g_mask = n_mask[:, None] & (groups < GROUPS)[None, :]
    scale = _group_field(s_ptr, rows_n, groups[None, :], g_mask, GROUPS, PER_SUPER)
    w = tl.reshape(q, (BLOCK_N, HALF // RUN, RUN)) * scale[:, :, None]
    if BITS == 4:
        w += _group_field(m_ptr, rows_n, groups[None, :], g_mask, GROUPS, PER_SUPER)[:, :, None]
    w = tl.reshape(w, (BLOCK_N, HALF)).to(VALUE_DTYPE).to(tl.float32)
    return w, cols


@triton.jit
def quant_stream_kernel(
    x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, GROUPS, GS, x_stride, y_stride, k_chunk,
    BITS: tl.constexpr, PER_SUPER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr,
    SPLIT_K: tl.constexpr, VALUE_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """y [M, N] = x [M, K] @ dequantize(w)^T (+ bias) for few rows, reading each weight
    row's bytes contiguously (`_half_step`). One row (BLOCK_M 1): fp32 multiply-adds into
    a [BLOCK_N, BLOCK_K / 2] accumulator summed once at the end; more: `tl.dot`. SPLIT_K
    > 1: program (m, n, s) sums K in [s * k_chunk, (s + 1) * k_chunk) into y's fp32
    partials [SPLIT_K, M, N] (the caller adds them up and the bias)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # int64 rows: every address below is a row times a row length, past 2^31 once N x K
    # is (Llama 3 405B's LM head: 128256 x 16384); int32 wrapped and read another row.
    rows_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask, n_mask = rows_m < M, rows_n < N
    HALF: tl.constexpr = BLOCK_K // 2
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum(K, (pid_k + 1) * k_chunk)
    for k0 in range(pid_k * k_chunk, k_end, BLOCK_K):
        for h in tl.static_range(2):
            w, cols = _half_step(w_ptr, s_ptr, m_ptr, rows_n, n_mask, k0, K, GROUPS, GS, h,
                                 BITS, PER_SUPER, BLOCK_N, HALF, RUN, VALUE_DTYPE)  # fmt: skip
            x_mask = m_mask[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows_m[:, None] * x_stride + cols[None, :], mask=x_mask,
                        other=0.0)  # fmt: skip
            if BLOCK_M == 1:
                acc2 += w * x.to(tl.float32)
            else:
                acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)),
                              input_precision=PRECISION)  # fmt: skip
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        out = y_ptr + pid_k.to(tl.int64) * M * N + rows_m[:, None] * N + rows_n[None, :]
        tl.store(out, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows_m[:, None] * y_stride + rows_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
