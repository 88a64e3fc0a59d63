"""The K-quants' layouts (passes/ops/quantized.py describes the formats): compact scale
fields, Q6_K's values in 6 bits and Q5_K's in 5; what both the CPU ops and the CUDA
kernel's launcher (`triton_quant.py`) read to size a row, kept apart so neither imports
the other."""

from __future__ import annotations

from types import MappingProxyType

import torch

# Compact fields by dtype: groups a super-block (whose fp32 scale follows the row's bytes).
GROUPS_PER_SUPER = MappingProxyType({torch.uint8: 8, torch.int8: 16})  # Q4_K's, Q6_K's


def is_compact(field: torch.Tensor) -> bool:
    return field.dtype in GROUPS_PER_SUPER


def groups_of(scales: torch.Tensor) -> int:
    """Groups a row of this scales field covers (compact: G bytes, then G/8 or G/16 fp32)."""
    if not is_compact(scales):
        return scales.shape[-1]
    per = GROUPS_PER_SUPER[scales.dtype]
    return scales.shape[-1] * per // (per + 4)


def pack_q6(q: torch.Tensor) -> torch.Tensor:
    """Q6_K's values q in [-32, 31], int8 [..., K] (K a multiple of 128), in 6 bits: uint8
    [..., 3K/4]. Per chunk of 128 values (4 runs of 32; u = q + 32): 64 bytes of low
    nibbles in q4's order (run r's byte j: value j low, value j + 16 high), then 32 bytes of
    top bit pairs, byte 16h + j holding those of runs h and 2 + h at position j (bits 0-1,
    2-3) and j + 16 (bits 4-5, 6-7). So a run's first 16 values' tops (a run's last 16's)
    sit in bits 0-3 (4-7) of the 32 bytes in the order their nibbles sit in the chunk's
    64, halves apart: two shifts by lane half and a mask put each value's top bits beside
    its nibble (quant_kernels.cpp, `row_product_q6_*`)."""
    lead, k = q.shape[:-1], q.shape[-1]
    u = (q.to(torch.int16) + 32).to(torch.uint8).reshape(*lead, k // 128, 2, 2, 2, 16)
    # [..., chunk, r // 2, r % 2, first / last 16, j]: run r = 2 (r // 2) + r % 2
    low, top = u & 15, u >> 4
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*lead, k // 128, 64)
    first, last = top[..., 0, :], top[..., 1, :]  # [..., chunk, r // 2, r % 2, j]
    pairs = first[..., 0, :, :] | (first[..., 1, :, :] << 2) | (last[..., 0, :, :] << 4)
    pairs = pairs | (last[..., 1, :, :] << 6)  # [..., chunk, h, j]: byte 16h + j
    return torch.cat([nibbles, pairs.reshape(*lead, k // 128, 32)], -1).reshape(*lead, k // 4 * 3)


def unpack_q6(w: torch.Tensor) -> torch.Tensor:
    """`pack_q6`'s inverse: uint8 [..., 3K/4] -> the values, int8 [..., K]."""
    lead, chunks = w.shape[:-1], w.shape[-1] // 96
    c = w.reshape(*lead, chunks, 96)
    nibbles = c[..., :64].reshape(*lead, chunks, 2, 2, 16)  # [..., r // 2, r % 2, j]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=w.device)
    bits = (c[..., 64:].reshape(*lead, chunks, 2, 16).unsqueeze(-1) >> shifts) & 3
    # bits [..., h, j, (first of run h, first of 2 + h, last of h, last of 2 + h)]
    first = bits[..., :2].permute(*range(len(lead)), -4, -1, -3, -2)  # [.., r//2, h, j]
    last = bits[..., 2:].permute(*range(len(lead)), -4, -1, -3, -2)
    u = torch.stack([(nibbles & 15) | (first << 4), (nibbles >> 4) | (last << 4)], -2)
    return (u.to(torch.int16) - 32).to(torch.int8).reshape(*lead, chunks * 128)


# A Q5_K row: per chunk of 128 values (4 runs of 32) 64 bytes of low nibbles in q4's order,
# then 16 bytes of the values' fifth bits, as the kernel ORs them in (`pack_q5`).
Q5_CHUNK_BYTES = 80


def is_q5(w: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether q4 fields hold Q5_K's 5-bit values (`pack_q5`): Q4_K's compact scales beside
    5/8 of a byte a value, where Q4_K's nibbles take half."""
    return scales.dtype == torch.uint8 and w.shape[-1] == groups_of(scales) * 20


def q4_columns(w: torch.Tensor, scales: torch.Tensor) -> int:
    """The values a row of q4 blocks holds (Q5_K's 5-bit rows: 8 for 5 bytes)."""
    return w.shape[-1] // 5 * 8 if is_q5(w, scales) else 2 * w.shape[-1]


def pack_q5(u: torch.Tensor) -> torch.Tensor:
    """Q5_K's values u in [0, 31], uint8 [..., K] (K a multiple of 128), in 5 bits: uint8
    [..., 5K/8]. Per chunk of 128 values (4 runs of 32): 64 bytes of low nibbles in q4's
    order (byte b = 16r + j: run r's value j low, value j + 16 high), then four 32-bit
    little-endian masks of fifth bits, one for each of the four vectors the kernel widens a
    chunk's nibbles into (quant/rows_bf16.h `row_product_q4_bf16`, words i = bytes 2i and
    2i + 1): the low nibbles of even bytes, of odd bytes, the high nibbles of even bytes,
    of odd bytes; bit i of mask P is the fifth bit of the value that vector's word i holds,
    so one masked OR puts it beside its nibble."""
    lead, k = u.shape[:-1], u.shape[-1]
    c = u.reshape(*lead, k // 128, 4, 2, 16)  # [..., chunk, run, first / last 16, j]
    low, fifth = c & 15, c >> 4
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*lead, k // 128, 64)
    first = fifth[..., 0, :].reshape(*lead, k // 128, 32, 2)  # byte 2i + e -> [i, e]
    last = fifth[..., 1, :].reshape(*lead, k // 128, 32, 2)
    bits = torch.stack([first[..., 0], first[..., 1], last[..., 0], last[..., 1]], -2)
    weights = torch.tensor([1 << s for s in range(8)], dtype=torch.int32, device=u.device)
    masks = (bits.reshape(*lead, k // 128, 16, 8).int() * weights).sum(-1).to(torch.uint8)
    return torch.cat([nibbles, masks], -1).reshape(*lead, k // 128 * Q5_CHUNK_BYTES)


def unpack_q5(w: torch.Tensor) -> torch.Tensor:
    """`pack_q5`'s inverse: uint8 [..., 5K/8] -> the values, uint8 [..., K]. Broadcast
    shifts only (no stack or concatenation, which Inductor's code for an embedding's rows
    would run as an aten call outside its kernels): value (run r, half h, j) is nibble
    byte 16r + j's half h, its fifth bit bit j // 2 of byte r of mask 2h + j % 2."""
    lead, chunks = w.shape[:-1], w.shape[-1] // Q5_CHUNK_BYTES
    c = w.reshape(*lead, chunks, Q5_CHUNK_BYTES)
    halves = (torch.arange(2, dtype=torch.uint8, device=w.device) * 4).reshape(2, 1)
    nibbles = (c[..., :64].reshape(*lead, chunks, 4, 1, 16) >> halves) & 15  # [.., r, h, j]
    n = len(lead) + 1  # masks [.., chunk, h, e, r] -> [.., chunk, r, h, 1, e]
    masks = c[..., 64:].reshape(*lead, chunks, 2, 2, 4).permute(*range(n), n + 2, n, n + 1)
    bits = torch.arange(8, dtype=torch.uint8, device=w.device).reshape(8, 1)
    fifth = (masks.unsqueeze(-2) >> bits) & 1  # [.., r, h, j // 2, j % 2]
    u = nibbles | (fifth.reshape(*lead, chunks, 4, 2, 16) << 4)
    return u.reshape(*lead, chunks * 128)


# IQ4_NL's (and IQ4_XS's) 16 values, which a 4-bit index selects (llama.cpp's
# `kvalues_iq4nl`); the values are integers, exact in bf16.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The table as two 64-bit words of value + 128 bytes (indices 0-7, 8-15), so a traced
# reference looks values up with shifts of scalars: no tensor constant in the graph.
_IQ4_WORDS = tuple(
    sum((v + 128) << (8 * i) for i, v in enumerate(IQ4_VALUES[h : h + 8])) for h in (0, 8)
)
_IQ4_WORDS = tuple(w - (1 << 64) if w >= 1 << 63 else w for w in _IQ4_WORDS)  # as int64


def is_iq4(w: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether q8 fields hold IQ4_NL / IQ4_XS's 4-bit indices (two a byte, in q4's order)
    beside fp32 scales for groups of 32 (Q6_K's 6-bit rows have compact int8 scales)."""
    return w.dtype == torch.uint8 and scales.dtype == torch.float32 and (
        w.shape[-1] * 2 == scales.shape[-1] * 32
    )


def iq4_values(indices: torch.Tensor) -> torch.Tensor:
    """IQ4_NL's values of 4-bit indices (any integer dtype), as int16."""
    n = indices.to(torch.int64)
    word = torch.where(n < 8, _IQ4_WORDS[0], _IQ4_WORDS[1])
    return (((word >> (8 * (n & 7))) & 255) - 128).to(torch.int16)
