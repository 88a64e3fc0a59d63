"""Rotary position embedding (neox style, as HF Llama's `rotate_half`) with a cos/sin
cache indexed by position. `get_rope` returns one shared module per distinct setting, so
all layers of a model share one cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from passes.ops.qkv_rope import apply_rope, rope_cos_sin


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    slow = inv_freq / factor
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * slow + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, slow, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, blended, out)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.max_position, self.base = max_position, base
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        inv_freq = _default_inv_freq(base, rotary_dim)
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3"
            )
        self.rope_type = rope_type
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        # Not persistent: it is derived, never loaded from a checkpoint.
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The same functions the QKV+RoPE pass traces its pattern from (passes/ops); cos and
        # sin are cast to the activation dtype first, as HF does, so bf16 matches it.
        cos, sin = rope_cos_sin(self.cos_sin_cache, positions, q.dtype)
        return apply_rope(q, cos, sin, self.head_size), apply_rope(k, cos, sin, self.head_size)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, base={self.base}, type={self.rope_type}"


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5's `rope_parameters` or the older fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    scaling = dict(legacy) if legacy else (params or None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta), scaling


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    scaling_key = tuple(sorted((rope_scaling or {}).items()))
    key = (head_size, rotary_dim, max_position, base, scaling_key, str(torch.get_default_device()))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling)
    return _ROPE_CACHE[key]
