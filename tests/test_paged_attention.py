"""The torch paged-attention backend equals dense causal attention computed from scratch,
for drawn block sizes, context and query lengths, GQA ratios and mixed batches."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.attention import AttentionMetadata, TorchPagedAttentionBackend


class _Layer:
    def __init__(self, num_heads, num_kv_heads, head_size, kv_cache):
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = head_size**-0.5
        self.kv_cache = kv_cache


def reference_attention(q, k, v, scale):
    """q [Lq, H, D] at the last Lq positions of k/v [L, KV, D]; plain softmax attention."""
    lq, h, _ = q.shape
    length, kvh, _ = k.shape
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(length - lq, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 4, 8, 16]))
    kv_heads = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 3]))
    head_size = draw(st.sampled_from([8, 16]))
    n_decode = draw(st.integers(0, 3))
    n_prefill = draw(st.integers(0 if n_decode else 1, 3))
    seqs = [(draw(st.integers(0, 40)), 1) for _ in range(n_decode)]  # (context, query)
    seqs += [(draw(st.integers(0, 40)), draw(st.integers(1, 20))) for _ in range(n_prefill)]
    padding = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    return block_size, kv_heads, kv_heads * ratio, head_size, seqs, padding, seed


@settings(max_examples=40, deadline=None)
@given(batches())
def test_paged_equals_dense(batch):
    block_size, kvh, h, d, seqs, padding, seed = batch
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables, q_rows, k_rows, v_rows, slots, full_kv = [], [], [], [], [], []
    for (ctx, qlen), nb in zip(seqs, blocks_per_seq):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        k = torch.randn(ctx + qlen, kvh, d, generator=g)
        v = torch.randn(ctx + qlen, kvh, d, generator=g)
        for p in range(ctx):  # the cached prefix, written by hand
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + qlen)
        ]
        q_rows.append(torch.randn(qlen, h, d, generator=g))
        k_rows.append(k[ctx:])
        v_rows.append(v[ctx:])
        full_kv.append((k, v))
    n = len(slots)
    q = torch.cat(q_rows + [torch.randn(padding, h, d, generator=g)]).reshape(n + padding, h * d)
    k_new = torch.cat(k_rows + [torch.randn(padding, kvh, d, generator=g)]).reshape(n + padding, -1)
    v_new = torch.cat(v_rows + [torch.randn(padding, kvh, d, generator=g)]).reshape(n + padding, -1)
    starts = [0]
    for _, qlen in seqs:
        starts.append(starts[-1] + qlen)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        num_actual_tokens=n,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + ql for c, ql in seqs], dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * padding, dtype=torch.int64),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(ql for _, ql in seqs),
        max_seq_len=max(c + ql for c, ql in seqs),
        # Rows with one query token at the front of the batch run as batched decodes.
        num_decodes=next((i for i, (_, ql) in enumerate(seqs) if ql != 1), len(seqs)),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[c + ql for c, ql in seqs],
    )
    before = cache.clone()
    layer = _Layer(h, kvh, d, cache)
    out = torch.full((n + padding, h * d), float("nan"))
    TorchPagedAttentionBackend().forward(layer, q, k_new, v_new, out, meta)

    for i, (_, qlen) in enumerate(seqs):
        k, v = full_kv[i]
        want = reference_attention(
            q[starts[i] : starts[i + 1]].reshape(qlen, h, d), k, v, layer.scale
        )
        got = out[starts[i] : starts[i + 1]].reshape(qlen, h, d).double()
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    # New K/V landed at their slots; nothing else changed (padding wrote nowhere).
    flat_before = before.reshape(2, -1, kvh, d)
    flat_after = cache.reshape(2, -1, kvh, d)
    written = torch.zeros(flat_after.shape[1], dtype=torch.bool)
    written[torch.tensor(slots, dtype=torch.long)] = True
    assert torch.equal(flat_after[:, ~written], flat_before[:, ~written])
    slot_index = torch.tensor(slots, dtype=torch.long)
    assert torch.equal(flat_after[0, slot_index], k_new[:n].reshape(n, kvh, d))
    assert torch.equal(flat_after[1, slot_index], v_new[:n].reshape(n, kvh, d))
