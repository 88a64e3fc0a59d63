"""RMSNorm with the residual kept outside: `norm(x, residual) -> (out, x + residual)`."""

from __future__ import annotations

import torch
from torch import nn

from passes.ops.add_rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # The same function the fusion pass traces its pattern from (passes/ops).
        return rms_norm(x, self.weight, self.variance_epsilon)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.forward_native(x)
        x = x + residual
        return self.forward_native(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
