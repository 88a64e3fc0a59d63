"""Triton paged attention: the GPU backend of the attention op.

Two kernels. `write_kv_cache` scatters the step's new K/V rows into the paged cache by
slot mapping (slot -1, a padding row, writes nothing). `unified_attention` serves a
mixed batch in two launches. Decodes: one program per (query token, KV head) finds its
sequence by binary search in `query_start_loc`, then walks that sequence's blocks up to
its own position, several pages a loop trip (TRIP_TOKENS keys), with an online softmax
in fp32; the query heads that share a KV head are the rows of both products (`tl.dot`,
padded to 16), so K/V are loaded once per group (GQA/MQA without copies). For
long contexts at small batch, a split-KV (flash-decoding) launch spreads each token's
blocks over several programs and a second kernel merges their partial softmaxes.
Prefill chunks: one program per (sequence, tile of query tokens, KV head), flash-
attention style: each K/V page is loaded once for the whole tile and QK^T and PV are
`tl.dot`s, so a 2,000-token prompt reads its prefix ~2,000/16 times instead of 2,000.

Every per-step value (offsets, lengths, block tables, slots) is read from device
tensors inside the kernels: no host synchronisation, so the runner can keep them in
persistent buffers while the compiled pieces around attention replay as CUDA graphs.
"""

from __future__ import annotations

import functools
import os

import torch

from passes.ops.triton_utils import row_num_warps
from runtime.attention.metadata import AttentionMetadata
from runtime.attention.torch_paged import ROWS_AS_DECODES

_kernels: dict = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernels() -> dict:
    if not _kernels:
        from runtime.attention import triton_kernels as tk

        _kernels.update(
            write=tk.write_kv_kernel,
            attention=tk.attention_kernel,
            merge=tk.merge_kernel,
            prefill=tk.prefill_attention_kernel,
        )
    return _kernels


def write_kv_cache_triton(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _, _, _, kv_heads, head = kv_cache.shape
    n = slot_mapping.shape[0]
    if n == 0:
        return
    row = kv_heads * head
    k, v = k.reshape(-1, row), v.reshape(-1, row)
    kernels()["write"][(n,)](
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        k.stride(0),
        v.stride(0),
        ROW=row,
        ROW_BLOCK=_next_pow2(row),
        num_warps=row_num_warps(_next_pow2(row)),
    )


# Keys a decode program reads in one loop trip (whole pages): the loads of a trip are
# independent, so a short context costs a trip or two of memory latency, not a page each.
TRIP_TOKENS = 64
# The fewest tokens one split of a sequence's KV walk takes (rounded up to whole trips):
# shorter walks would cost more in the merge than they save.
SPLIT_MIN_TOKENS = 64


def pages_per_trip(block_size: int, trip_tokens: int = TRIP_TOKENS) -> int:
    """Pages a decode loop trip reads: `trip_tokens` of keys, at least one page, and at
    least 16 keys (tl.dot's smallest tile)."""
    return _next_pow2(max(1, trip_tokens // block_size, -(-16 // block_size)))


def choose_num_splits(num_tokens: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> int:
    """Split the KV walk when few programs would each walk a long context."""
    programs = num_tokens * num_kv_heads
    blocks = -(-max_seq_len // block_size)
    if programs >= 128 or blocks < 64:
        return 1
    return min(16, max(2, 128 // programs), blocks // 16)


# The split counts whose kernels differ (SPLIT, and the merge's SPLIT_BLOCK: the next
# power of two): `choose_num_splits` returns 1..16, each compiled as one of these.
SPLIT_VARIANTS = (1, 2, 4, 8, 16)


def split_variant(num_splits: int) -> int:
    """The variant in SPLIT_VARIANTS whose compiled kernels run `num_splits` splits."""
    return 1 if num_splits <= 1 else _next_pow2(num_splits)


def prefill_tile_rows(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per prefill tile: 64 rows of (token, head) per program, at least 16
    tokens (tl.dot's smallest tile)."""
    group = _next_pow2(num_heads // num_kv_heads)
    return max(16, 64 // group)


def paged_attention_triton(
    q,
    kv_cache,
    output,
    meta: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    head: int,
    scale: float,
    num_splits: int | None = None,
    prefill_tiles: bool = True,
    trip_tokens: int = TRIP_TOKENS,
    rows_as_decodes: int = 0,
) -> None:
    """Decodes (and, without tiles, every token) through the per-token kernel; prefill
    sequences through the tiled tl.dot kernel when the page and head allow its tiles.
    `rows_as_decodes` (batch-invariant mode): queries of at most that many tokens go
    through the per-token kernel too, each row as the decode at its position."""
    n = meta.num_actual_tokens
    if n == 0:
        return
    block = kv_cache.shape[2]
    q = q.reshape(q.shape[0], -1)
    tiles = prefill_tiles and block >= 16 and head >= 16 and meta.max_query_len > 1
    per_token = meta.num_decodes if tiles else n  # decodes come first, one token each
    starts = meta.query_start_loc_cpu
    if tiles and any(starts[i + 1] - starts[i] <= rows_as_decodes
                     for i in range(meta.num_decodes, meta.num_seqs)):  # fmt: skip
        per_token = n  # every row, then the tiles rewrite the longer queries' rows
    if per_token:
        _per_token_attention(
            q, kv_cache, output, meta, per_token, num_heads, num_kv_heads, head, scale,
            num_splits, trip_tokens,
        )  # fmt: skip
    if tiles and meta.num_seqs > meta.num_decodes:
        _prefill_attention(q, kv_cache, output, meta, num_heads, num_kv_heads, head, scale,
                           rows_as_decodes)  # fmt: skip


def _dot_options(dtype: torch.dtype) -> dict:
    return dict(
        # fp32 models want fp32 answers: TF32 would cost three decimal digits.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bf16 operands as their raw uint16 bits.
        DOT_F32=os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16,
    )


def _constants(num_heads: int, num_kv_heads: int, head: int, block: int) -> dict:
    group = num_heads // num_kv_heads
    return dict(
        NUM_KV=num_kv_heads,
        GROUP=group,
        GROUP_BLOCK=_next_pow2(group),
        HEAD=head,
        HEAD_BLOCK=_next_pow2(head),
        BLOCK=block,
    )


def _per_token_attention(
    q, kv_cache, output, meta, n, num_heads, num_kv_heads, head, scale, num_splits, trip_tokens
) -> None:
    block = kv_cache.shape[2]
    if num_splits is None:
        num_splits = choose_num_splits(n, num_kv_heads, meta.max_seq_len, block)
    part = (
        q.new_empty((n, num_heads, num_splits, head + 2), dtype=torch.float32)
        if num_splits > 1
        else q.new_empty(1, dtype=torch.float32)
    )
    table = meta.block_table
    kernels()["attention"][(n, num_kv_heads, num_splits)](
        q,
        kv_cache[0],
        kv_cache[1],
        output,
        part,
        meta.query_start_loc,
        meta.seq_lens,
        table,
        meta.num_seqs,
        scale,
        q.stride(0),
        output.stride(0),
        table.stride(0),
        SPLIT=num_splits > 1,
        SPLIT_MIN=max(1, SPLIT_MIN_TOKENS // block),
        PAGES=pages_per_trip(block, trip_tokens),
        **_dot_options(q.dtype),
        num_warps=4,
        num_stages=2,
        **{
            **_constants(num_heads, num_kv_heads, head, block),
            # tl.dot's smallest tile: the group's heads and the head padded to 16.
            "GROUP_BLOCK": max(16, _next_pow2(num_heads // num_kv_heads)),
            "HEAD_BLOCK": max(16, _next_pow2(head)),
        },
    )
    if num_splits > 1:
        kernels()["merge"][(n, num_heads)](
            part,
            output,
            output.stride(0),
            num_splits,
            HEAD=head,
            HEAD_BLOCK=_next_pow2(head),
            SPLIT_BLOCK=_next_pow2(num_splits),
        )


def _prefill_attention(
    q, kv_cache, output, meta, num_heads, num_kv_heads, head, scale, min_query
) -> None:
    block = kv_cache.shape[2]
    tile = prefill_tile_rows(num_heads, num_kv_heads)
    prefills = meta.num_seqs - meta.num_decodes
    grid = (prefills, -(-meta.max_query_len // tile), num_kv_heads)
    kernels()["prefill"][grid](
        q,
        kv_cache[0],
        kv_cache[1],
        output,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        meta.num_decodes,
        min_query,
        scale,
        q.stride(0),
        output.stride(0),
        meta.block_table.stride(0),
        BLOCK_M=tile,
        **_dot_options(q.dtype),
        num_warps=4,
        num_stages=2,
        **_constants(num_heads, num_kv_heads, head, block),
    )


class TritonPagedAttentionBackend:
    name = "triton"
    # Capturable inside a whole-step CUDA graph: every per-step value is read on the
    # device, and a decode launch is fixed by the batch size and `max_seq_len`.
    supports_full_cudagraph = True

    def __init__(
        self, num_splits: int | None = None, prefill_tiles: bool = True,
        trip_tokens: int = TRIP_TOKENS, invariant: bool = False,
    ):  # fmt: skip
        self.num_splits = num_splits  # None: chosen per step by choose_num_splits
        self.prefill_tiles = prefill_tiles
        self.trip_tokens = trip_tokens  # keys a decode loop trip reads (whole pages)
        # Batch-invariant mode: no split (the split count follows the batch), and short
        # queries' rows attend as decodes (tests/test_triton_attention.py).
        self.rows_as_decodes = ROWS_AS_DECODES if invariant else 0
        if invariant:
            self.num_splits = 1

    def warm_up(self, layer, kv_cache: torch.Tensor) -> int:
        """Compile every decode variant for `layer`'s shapes now (each split variant and
        its merge, on one dummy sequence over `kv_cache`'s first block, writing nothing):
        the steps choose splits by their longest context, and a variant first met while
        serving compiled there (0.5-2 s). Returns the launches made."""
        heads, kv, head = layer.num_heads, layer.num_kv_heads, layer.head_size
        block, dev = kv_cache.shape[2], kv_cache.device
        q = torch.zeros(1, heads * head, dtype=kv_cache.dtype, device=dev)
        meta = AttentionMetadata(
            num_actual_tokens=1,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            seq_lens=torch.ones(1, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=dev),
            block_table=torch.zeros(1, 1, dtype=torch.int32, device=dev),
            max_query_len=1, max_seq_len=block, num_decodes=1,
            query_start_loc_cpu=[0, 1], seq_lens_cpu=[1],
        )  # fmt: skip
        for splits in SPLIT_VARIANTS:
            paged_attention_triton(q, kv_cache, torch.empty_like(q), meta, heads, kv, head,
                                   layer.scale, splits, self.prefill_tiles,
                                   self.trip_tokens)  # fmt: skip
        return len(SPLIT_VARIANTS)

    def forward(self, layer, q, k, v, output, attn_metadata: AttentionMetadata) -> None:
        meta = attn_metadata
        if meta is None:  # a profiling or tracing run with no real batch
            output.zero_()
            return
        n = meta.num_actual_tokens
        write_kv_cache_triton(layer.kv_cache, k[:n], v[:n], meta.slot_mapping[:n])
        paged_attention_triton(
            q,
            layer.kv_cache,
            output,
            meta,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_size,
            layer.scale,
            self.num_splits,
            self.prefill_tiles,
            self.trip_tokens,
            self.rows_as_decodes,
        )


def triton_usable(device: torch.device) -> bool:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and interpreter_problem() is None


@functools.cache
def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run these kernels here, or None. Triton 3.6's
    interpreter gives program ids as 1-element arrays, which numpy 2.4 refuses to turn
    into loop bounds (compiled kernels on a GPU are not affected)."""
    import numpy
    import triton

    from runtime.attention.triton_kernels import interpreter_probe_kernel

    try:
        interpreter_probe_kernel[(2,)](torch.zeros(1, dtype=torch.int32))
    except Exception as exc:  # the interpreter's own error types differ by version
        return (
            f"Triton {triton.__version__}'s interpreter cannot run a loop bounded by a "
            f"program id with numpy {numpy.__version__} ({type(exc).__name__}: {exc}); Triton "
            "3.8 runs them"
        )
    return None
