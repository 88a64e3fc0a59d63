"""Random paged-attention batches and the dense oracle, shared by the torch and Triton
backend tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import assume
from hypothesis import strategies as st

from compilecore import testing
from runtime.attention import AttentionMetadata


class FakeLayer:
    """What a backend reads from an attention layer (a plain record, no model)."""

    def __init__(self, num_heads, num_kv_heads, head_size, kv_cache):
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = head_size**-0.5
        self.kv_cache = kv_cache


def reference_attention(q, k, v, scale):
    """q [Lq, H, D] at the last Lq positions of k/v [L, KV, D]; softmax attention in fp64."""
    lq, h, _ = q.shape
    length, kvh, _ = k.shape
    k = k.double().repeat_interleave(h // kvh, dim=1)
    v = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(length - lq, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@st.composite
def batches(
    draw,
    head_sizes=(8, 16),
    block_sizes=(1, 4, 8, 16),
    max_ctx=40,
    max_q=20,
    max_seqs=3,
    dtypes=(torch.float32,),
):
    kv_heads = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 3]))
    # The mixture of decodes and prefill chunks comes from the public strategy.
    spec = draw(testing.batches(max_seqs=max_seqs, max_context=max_ctx, max_query=max_q))
    seqs = spec.seqs
    return Batch(
        block_size=draw(st.sampled_from(block_sizes)),
        kv_heads=kv_heads,
        heads=kv_heads * ratio,
        head_size=draw(st.sampled_from(head_sizes)),
        seqs=seqs,
        padding=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(dtypes)),
    )


@dataclass
class Batch:
    block_size: int
    kv_heads: int
    heads: int
    head_size: int
    seqs: list[tuple[int, int]]
    padding: int
    seed: int
    dtype: torch.dtype = torch.float32


@dataclass
class Case:
    layer: FakeLayer
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata
    full_kv: list[tuple[torch.Tensor, torch.Tensor]]
    slots: list[int]
    cache_before: torch.Tensor


def build_case(b: Batch) -> Case:
    g = torch.Generator().manual_seed(b.seed)
    bs, kvh, h, d = b.block_size, b.kv_heads, b.heads, b.head_size
    blocks_per_seq = [math.ceil((c + q) / bs) for c, q in b.seqs]
    num_blocks = sum(blocks_per_seq) + 2
    cache = torch.randn(2, num_blocks, bs, kvh, d, generator=g).to(b.dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables, q_rows, k_rows, v_rows, slots, full_kv = [], [], [], [], [], []
    for (ctx, qlen), nb in zip(b.seqs, blocks_per_seq):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        k = torch.randn(ctx + qlen, kvh, d, generator=g).to(b.dtype)
        v = torch.randn(ctx + qlen, kvh, d, generator=g).to(b.dtype)
        for p in range(ctx):  # the cached prefix, written by hand
            cache[0, table[p // bs], p % bs] = k[p]
            cache[1, table[p // bs], p % bs] = v[p]
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + qlen)]
        q_rows.append(torch.randn(qlen, h, d, generator=g).to(b.dtype))
        k_rows.append(k[ctx:])
        v_rows.append(v[ctx:])
        full_kv.append((k, v))
    n, pad = len(slots), b.padding

    def rows(parts, heads):
        extra = torch.randn(pad, heads, d, generator=g).to(b.dtype)
        return torch.cat(parts + [extra]).reshape(n + pad, heads * d)

    starts = [0]
    for _, qlen in b.seqs:
        starts.append(starts[-1] + qlen)
    lens = [c + ql for c, ql in b.seqs]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        num_actual_tokens=n,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(ql for _, ql in b.seqs),
        max_seq_len=max(lens),
        # Rows with one query token at the front of the batch run as batched decodes.
        num_decodes=next((i for i, (_, ql) in enumerate(b.seqs) if ql != 1), len(b.seqs)),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    layer = FakeLayer(h, kvh, d, cache)
    return Case(
        layer,
        rows(q_rows, h),
        rows(k_rows, kvh),
        rows(v_rows, kvh),
        meta,
        full_kv,
        slots,
        cache.clone(),
    )


def run_and_check(case: Case, backend, tol: float = 1e-5) -> torch.Tensor:
    """Run the backend; check outputs against the dense oracle and the cache writes."""
    out = torch.full_like(case.q, float("nan"))
    backend.forward(case.layer, case.q, case.k, case.v, out, case.meta)
    return check_case(case, out, tol)


def check_case(case: Case, out: torch.Tensor, tol: float = 1e-5) -> torch.Tensor:
    """`out` and the cache against the dense oracle and the slots the batch writes."""
    layer, meta = case.layer, case.meta
    h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    starts = meta.query_start_loc_cpu
    for i, (k, v) in enumerate(case.full_kv):
        s, e = starts[i], starts[i + 1]
        want = reference_attention(case.q[s:e].reshape(e - s, h, d), k, v, layer.scale)
        got = out[s:e].reshape(e - s, h, d).double()
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    n = meta.num_actual_tokens
    before = case.cache_before.reshape(2, -1, kvh, d)
    after = layer.kv_cache.reshape(2, -1, kvh, d)
    slots = torch.tensor(case.slots, dtype=torch.long)
    written = torch.zeros(after.shape[1], dtype=torch.bool)
    written[slots] = True
    same = after[:, ~written] == before[:, ~written]
    stale = after[:, ~written].isnan() & before[:, ~written].isnan()
    assert (same | stale).all()  # padding wrote nowhere
    assert torch.equal(after[0, slots], case.k[:n].reshape(n, kvh, d))
    assert torch.equal(after[1, slots], case.v[:n].reshape(n, kvh, d))
    return out


@st.composite
def invariant_batches(draw, block_sizes=(16,), head_sizes=(64,), max_ctx=300, max_seqs=4):
    """Batch-invariant mode's batches: decodes and other queries (short ones: speculative
    verifications, recomputed tokens; longer prefill chunks) over short and long
    contexts, fp32 or bf16."""
    kv_heads = draw(st.integers(1, 3))
    decodes = [(draw(st.integers(0, max_ctx)), 1) for _ in range(draw(st.integers(0, max_seqs)))]
    others = [(draw(st.integers(0, max_ctx * 2 // 3)), draw(st.integers(1, 24)))
              for _ in range(draw(st.integers(0, max_seqs - 1)))]  # fmt: skip
    assume(decodes or others)
    return Batch(block_size=draw(st.sampled_from(block_sizes)), kv_heads=kv_heads,
                 heads=kv_heads * draw(st.sampled_from([1, 3])),
                 head_size=draw(st.sampled_from(head_sizes)), seqs=decodes + others,
                 padding=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)),
                 dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])))  # fmt: skip


def case_seqs(case: Case) -> list[tuple[int, int]]:
    """Each sequence's (cached context, query length)."""
    starts, lens = case.meta.query_start_loc_cpu, case.meta.seq_lens_cpu
    return [(lens[i] - (starts[i + 1] - starts[i]), starts[i + 1] - starts[i])
            for i in range(len(lens))]  # fmt: skip


def as_decode_alone(case: Case, backend, seq: int, row: int) -> torch.Tensor:
    """Query row `row` of sequence `seq`, attended alone as the decode at its position
    (after the case's batch wrote its K/V)."""
    (ctx, _), start = case_seqs(case)[seq], case.meta.query_start_loc_cpu[seq]
    length = ctx + row + 1
    meta = AttentionMetadata(
        num_actual_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32), slot_mapping=torch.tensor([-1]),
        block_table=case.meta.block_table[seq : seq + 1], max_query_len=1,
        max_seq_len=length, num_decodes=1, query_start_loc_cpu=[0, 1], seq_lens_cpu=[length],
    )  # fmt: skip
    out = torch.empty_like(case.q[:1])
    q = case.q[start + row : start + row + 1]
    backend.forward(case.layer, q, case.k[:1], case.v[:1], out, meta)
    return out[0]


def check_rows_as_decodes(case: Case, out: torch.Tensor, backend, rows: int) -> None:
    """Each decode, and each row of a query of at most `rows` tokens, has the bits of the
    decode at its position run alone."""
    for i, (_, qlen) in enumerate(case_seqs(case)):
        if qlen <= rows:
            start = case.meta.query_start_loc_cpu[i]
            for j in range(qlen):
                assert torch.equal(out[start + j], as_decode_alone(case, backend, i, j)), (i, j)
