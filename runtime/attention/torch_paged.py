"""Paged attention in torch: the CPU backend and the oracle for the Triton kernel.

New K/V rows go into the cache by slot mapping; each query then attends over its
sequence's cached prefix plus the causal part of the new tokens. Decode rows (one new
token each) run as one batched call; prefill chunks run per sequence.

Every layer of a step reads the same block tables, so the cache slots to gather (and the
masks) are worked out once per step, on the first layer, and kept on the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from passes.ops.quantized import INVARIANT_ROWS
from runtime.attention.dense import sdpa
from runtime.attention.metadata import AttentionMetadata


def write_kv_cache(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_cache [2, num_blocks, block_size, kv_heads, head_size]; slots of -1 write nothing."""
    _, nb, bs, kvh, d = kv_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kv_cache[0].view(nb * bs, kvh, d)[slots] = k.reshape(-1, kvh, d)[valid]
    kv_cache[1].view(nb * bs, kvh, d)[slots] = v.reshape(-1, kvh, d)[valid]


def token_slots(block_table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of the first `num_tokens` tokens of sequences [..., n_blocks]
    -> [..., num_tokens]."""
    pos = torch.arange(num_tokens, device=block_table.device)
    return block_table[..., pos // block_size].long() * block_size + pos % block_size


def gather_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, nb, bs, kvh, d = kv_cache.shape
    flat = slots.reshape(-1)
    k = kv_cache[0].view(nb * bs, kvh, d).index_select(0, flat).view(*slots.shape, kvh, d)
    v = kv_cache[1].view(nb * bs, kvh, d).index_select(0, flat).view(*slots.shape, kvh, d)
    return k.transpose(-3, -2), v.transpose(-3, -2)


FP32_DECODE_MAX_LEN = 1024
# Batch-invariant mode computes queries this short row by row, as decodes: a speculative
# verification's rows then equal the decodes they stand for (tests/test_spec_decode.py).
# The products' short-row path has the same bound (the scheduler keeps one threshold).
ROWS_AS_DECODES = INVARIANT_ROWS


@dataclass
class _StepPlan:
    """What every layer of one step gathers (built on the first layer)."""

    slots_valid: bool
    decode_slots: torch.Tensor | None  # [num_decodes, max_len]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] or None (one sequence)
    decode_bias: torch.Tensor | None  # the same as 0 / -inf, for adding to scores
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # start, end, slots, mask
    # (row, its keys' slots): the rows computed one at a time (per_sequence)
    decode_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)


def _plan(meta: AttentionMetadata, block_size: int, decode: bool = True) -> _StepPlan:
    n, nd = meta.num_actual_tokens, meta.num_decodes
    slots_valid = bool((meta.slot_mapping[:n] >= 0).all()) if n else True
    decode_slots = decode_mask = decode_bias = None
    if nd and decode:
        lens = meta.seq_lens_cpu[:nd]
        decode_slots = token_slots(meta.block_table[:nd], max(lens), block_size)
        if nd > 1:
            valid = torch.arange(max(lens), device=decode_slots.device) < meta.seq_lens[:nd, None]
            decode_mask = valid[:, None, None, :]
            decode_bias = torch.zeros(decode_mask.shape, device=valid.device).masked_fill(
                ~decode_mask, float("-inf")
            )
    prefill = []
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in range(nd, meta.num_seqs):
        s, e, seq_len = starts[i], starts[i + 1], lens[i]
        slots = token_slots(meta.block_table[i], seq_len, block_size)
        mask = None
        if seq_len != e - s:  # a cached prefix: query j sits at position seq_len - (e - s) + j
            q_pos = torch.arange(seq_len - (e - s), seq_len, device=slots.device)
            mask = torch.arange(seq_len, device=slots.device)[None, :] <= q_pos[:, None]
        prefill.append((s, e, slots, mask))
    return _StepPlan(slots_valid, decode_slots, decode_mask, decode_bias, prefill)


class TorchPagedAttentionBackend:
    name = "torch"
    # Batch-invariant mode: each decode row attends in a call of its own, the call a batch
    # of one makes (the batched path pads to the longest sequence, and its reductions run
    # over that length).
    per_sequence = False

    def __init__(self, per_sequence: bool = False):
        self.per_sequence = per_sequence

    def forward(self, layer, q, k, v, output, attn_metadata: AttentionMetadata) -> None:
        meta = attn_metadata
        if meta is None:  # a profiling or tracing run with no real batch
            output.zero_()
            return
        kv_cache = layer.kv_cache
        plan = meta.cache.get("torch_paged")
        if plan is None:
            plan = _plan(meta, kv_cache.shape[2], decode=not self.per_sequence)
            if self.per_sequence:
                self._rows_as_decodes(meta, plan, kv_cache.shape[2])
            meta.cache["torch_paged"] = plan
        h, d = layer.num_heads, layer.head_size
        n, nd = meta.num_actual_tokens, meta.num_decodes
        if plan.slots_valid:
            _, nb, bs, kvh, _ = kv_cache.shape
            slots = meta.slot_mapping[:n]
            kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slots, k[:n].reshape(n, kvh, d))
            kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slots, v[:n].reshape(n, kvh, d))
        else:
            write_kv_cache(kv_cache, k[:n], v[:n], meta.slot_mapping[:n])
        if self.per_sequence:
            for i, slots in plan.decode_rows:
                ks, vs = gather_slots(kv_cache, slots[None])
                output[i] = self._decode(q[i].reshape(1, h, 1, d), ks, vs, layer.scale)[0]
        elif nd:
            ks, vs = gather_slots(kv_cache, plan.decode_slots)  # [nd, KV, L, D]
            output[:nd] = self._decode(q[:nd].reshape(nd, h, 1, d), ks, vs, layer.scale, plan)
        self._prefill(layer, q, kv_cache, output, plan)

    @staticmethod
    def _rows_as_decodes(meta: AttentionMetadata, plan: _StepPlan, block_size: int) -> None:
        """Batch-invariant mode: each decode, and each row of a query of at most
        ROWS_AS_DECODES tokens (a speculative verification), attends in the call a decode
        at its position makes, so a verified token gets the bits decoding gives it."""
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            if i >= meta.num_decodes and e - s > ROWS_AS_DECODES:
                continue
            for row in range(s, e):
                length = int(lens[i]) - (e - 1 - row)  # the keys up to its own position
                plan.decode_rows.append((row, token_slots(meta.block_table[i], length, block_size)))
        plan.prefill = [p for p in plan.prefill if p[1] - p[0] > ROWS_AS_DECODES]

    @staticmethod
    def _prefill(layer, q, kv_cache, output, plan: _StepPlan) -> None:
        """Prefill chunks, one sequence at a time, over their gathered K/V."""
        h, d = layer.num_heads, layer.head_size
        for s, e, slots, mask in plan.prefill:
            ks, vs = gather_slots(kv_cache, slots)
            qs = q[s:e].reshape(e - s, h, d).transpose(0, 1)
            if mask is None:  # a whole prompt: plain causal, SDPA's fast path
                out = sdpa(qs, ks, vs, layer.scale, is_causal=True)
            else:
                out = sdpa(qs, ks, vs, layer.scale, attn_mask=mask)
            output[s:e] = out.transpose(0, 1).reshape(e - s, h * d)

    @staticmethod
    def _decode(q, k, v, scale: float, plan: _StepPlan | None = None) -> torch.Tensor:
        """One query token per sequence: q [nd, H, 1, D], k/v [nd, KV, L, D] -> [nd, H * D].

        On CPU, SDPA is slow here in 16 bits with a mask (its math path, 12x the time of the two
        batched matmuls below at 32 x 400 tokens), and for a single sequence in 16 bits it is
        fastest in fp32 (docs/kernel-choices.md, Decode attention)."""
        nd, h, _, d = q.shape
        kvh = k.shape[1]
        if plan is None or plan.decode_mask is None:  # one sequence, no padding
            if q.dtype != torch.float32 and k.shape[-2] <= FP32_DECODE_MAX_LEN:
                out = sdpa(q.float(), k.float(), v.float(), scale).to(q.dtype)
            else:
                out = sdpa(q, k, v, scale)
            return out.reshape(nd, h * d)
        groups = q.view(nd, kvh, h // kvh, d)  # query heads that share a KV head
        scores = torch.matmul(groups, k.transpose(-1, -2)).float() * scale + plan.decode_bias
        probs = scores.softmax(-1).to(q.dtype)
        return torch.matmul(probs, v).reshape(nd, h * d)
