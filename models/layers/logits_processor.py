from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compilecore.parallel_state import tensor_model_parallel_all_gather
from models.layers.vocab_embedding import ParallelLMHead


class LogitsProcessor(nn.Module):
    """Hidden states -> logits over the whole vocabulary (gathered across TP ranks)."""

    def __init__(self, vocab_size: int, scale: float = 1.0):
        super().__init__()
        self.vocab_size, self.scale = vocab_size, scale

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, lm_head.weight, lm_head.bias)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.vocab_size]
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
