"""The Triton kernels of the paged-attention backend (imported only where Triton is
usable; see triton_paged.py for what they do)."""

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    k_stride,
    v_stride,
    ROW: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    cols = tl.arange(0, ROW_BLOCK)
    mask = (cols < ROW) & ((cols * 0 + slot) >= 0)  # a block mask: padding rows write nothing
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(kc_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(vc_ptr + slot * ROW + cols, v, mask=mask)


@triton.jit
def find_seq(query_start_loc_ptr, num_seqs, token):
    lo = 0
    hi = num_seqs
    while lo < hi:  # the last sequence whose first token is <= token
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid + 1) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo


# Integers that change from step to step are not specialized: Triton compiles a variant
# for a value of 1 and for one divisible by 16, and the CUDA graphs' capture warms only the
# sizes it runs, so a new batch shape would otherwise compile (0.5-2 s) mid-serving.
@triton.jit(do_not_specialize=["num_seqs"])
def attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    part_ptr,
    qsl_ptr,
    seq_lens_ptr,
    table_ptr,
    num_seqs,
    scale,
    q_stride,
    out_stride,
    table_stride,
    NUM_KV: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGES: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_MIN: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # One program per (query token, KV head, split). Its rows are the group's query heads
    # (padded to tl.dot's 16); a loop trip reads PAGES pages at once, so a short context is
    # a trip or two of independent loads rather than one dependent trip per page.
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = find_seq(qsl_ptr, num_seqs, token)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_pos = tl.load(seq_lens_ptr + seq) - q_len + (token - q_start)  # its position

    g = tl.arange(0, GROUP_BLOCK)
    d = tl.arange(0, HEAD_BLOCK)
    g_mask, d_mask = g < GROUP, d < HEAD
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + token * q_stride + heads[:, None] * HEAD + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, HEAD_BLOCK], tl.float32)

    num_blocks = q_pos // BLOCK + 1
    if SPLIT:
        # Each sequence spreads its own blocks over the launch's splits, whole trips of at
        # least SPLIT_MIN blocks: read here, on the device, since a full CUDA graph's
        # launch is fixed for the longest context while each replay's lengths differ.
        per_split = tl.maximum(tl.cdiv(num_blocks, tl.num_programs(2)), SPLIT_MIN)
        per_split = tl.cdiv(per_split, PAGES) * PAGES
        first = split * per_split
        last = tl.minimum(first + per_split, num_blocks)
    else:
        first = 0
        last = num_blocks
    t = tl.arange(0, PAGES * BLOCK)
    for b in range(first, last, PAGES):
        # Splits hold whole trips, so only the walk's last trip runs past `last`: its keys
        # lie past q_pos, and the table is not read there.
        page = b + t // BLOCK
        block_id = tl.load(table_ptr + seq * table_stride + page, mask=page < last, other=0)
        k_pos = b * BLOCK + t
        visible = k_pos <= q_pos
        rows = (block_id.to(tl.int64) * BLOCK + t % BLOCK) * NUM_KV * HEAD + kv_head * HEAD
        kv_mask = visible[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP, PAGES*BLOCK]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: a trip starts at a visible key
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:  # partial results: [token, head, split, HEAD + 2] = (acc, m, l)
        num_splits = tl.num_programs(2)
        base = ((token * NUM_KV * GROUP + heads) * num_splits + split) * (HEAD + 2)
        tl.store(part_ptr + base[:, None] + d[None, :], acc, mask=out_mask)
        tl.store(part_ptr + base + HEAD, m, mask=g_mask)
        tl.store(part_ptr + base + HEAD + 1, l_sum, mask=g_mask)
    else:
        out = acc / l_sum[:, None]
        dst = out_ptr + token * out_stride + heads[:, None] * HEAD + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def merge_kernel(
    part_ptr,
    out_ptr,
    out_stride,
    num_splits,
    HEAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    sp = tl.arange(0, SPLIT_BLOCK)
    d = tl.arange(0, HEAD_BLOCK)
    sp_mask, d_mask = sp < num_splits, d < HEAD
    base = ((token * num_heads + head) * num_splits + sp) * (HEAD + 2)
    m = tl.load(part_ptr + base + HEAD, mask=sp_mask, other=float("-inf"))
    l_sum = tl.load(part_ptr + base + HEAD + 1, mask=sp_mask, other=0.0)
    acc = tl.load(
        part_ptr + base[:, None] + d[None, :],
        mask=sp_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_all = tl.max(m, axis=0)
    w = tl.where(sp_mask & (l_sum > 0), tl.exp(m - m_all), 0.0)
    total = tl.sum(w * l_sum, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(
        out_ptr + token * out_stride + head * HEAD + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@triton.jit(do_not_specialize=["first_seq", "min_query"])
def prefill_attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    table_ptr,
    first_seq,
    min_query,
    scale,
    q_stride,
    out_stride,
    table_stride,
    NUM_KV: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # One program per (sequence, tile of BLOCK_M query tokens, KV head). The tile's rows
    # are (token, query head of the group) pairs, so every K/V page is loaded once for
    # BLOCK_M * GROUP rows and both products run on the tensor cores. Queries of at most
    # `min_query` tokens are left alone (batch-invariant mode attends them as decodes).
    seq = first_seq + tl.program_id(0)
    tile_start = tl.program_id(1) * BLOCK_M
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M * GROUP_BLOCK)
    tok = tile_start + r // GROUP_BLOCK
    g = r % GROUP_BLOCK
    d = tl.arange(0, HEAD_BLOCK)
    row_mask = (tok < q_len) & (g < GROUP) & (q_len > min_query)
    d_mask = d < HEAD
    q_pos = ctx + tok
    heads = kv_head * GROUP + g
    q_rows = (q_start + tok).to(tl.int64) * q_stride + heads * HEAD
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M * GROUP_BLOCK], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M * GROUP_BLOCK], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_BLOCK, HEAD_BLOCK], tl.float32)

    last_pos = ctx + tl.minimum(tile_start + BLOCK_M, q_len) - 1  # the tile's causal horizon
    num_blocks = tl.where((tile_start < q_len) & (q_len > min_query), last_pos // BLOCK + 1, 0)
    offs = tl.arange(0, BLOCK)
    for b in range(0, num_blocks):
        block_id = tl.load(table_ptr + seq * table_stride + b).to(tl.int64)
        k_pos = b * BLOCK + offs
        rows = (block_id * BLOCK + offs) * NUM_KV * HEAD + kv_head * HEAD
        # Slots past the sequence hold stale data, maybe NaN: 0 * NaN would leak into P @ V.
        kv_mask = (k_pos < seq_len)[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, BLOCK]
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: block 0 is visible to every row
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    # A tile past the prompt's end runs no block: its rows (never stored) divide 0 by 0.
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    out_rows = (q_start + tok).to(tl.int64) * out_stride + heads * HEAD
    tl.store(
        out_ptr + out_rows[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def interpreter_probe_kernel(out_ptr):
    # A loop bounded by a program id, as the attention kernels' block loops are.
    for i in range(0, tl.program_id(0) + 1):
        tl.store(out_ptr, i)
