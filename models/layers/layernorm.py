"""RMSNorm with the residual kept outside: `norm(x, residual) -> (out, x + residual)`."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 and cast back before the weight, exactly as HF transformers does,
        # so bf16 results agree with the reference bit for bit where possible.
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.forward_native(x)
        x = x + residual
        return self.forward_native(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
