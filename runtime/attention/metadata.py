from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """One step's layout of a packed batch of B sequences and T new tokens.

    Sequences whose query length is 1 (decodes) come first, `num_decodes` of them, so
    backends can treat them as one batched matrix-vector problem.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [B + 1] int32: offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens per sequence
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token, -1 for padding
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    # Host copies, so CPU-side loops never synchronise with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Per-step values a backend derives once and every layer reuses (gather indices, masks).
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def dense(cls, seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Plain causal attention over packed prompts (no KV cache)."""
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        return cls(
            num_actual_tokens=starts[-1],
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=device),
            block_table=torch.zeros((len(seq_lens), 0), dtype=torch.int32, device=device),
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
            num_decodes=0,
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
        )
