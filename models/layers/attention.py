"""The attention layer: the one place where the compiled graph is cut.

The layer registers itself under its prefix in the config's static forward context and
calls the custom op `compilecore::unified_attention_with_output`. The op finds the layer
(and through it the KV cache and the backend the runtime bound to it) and the step's
metadata in the forward context, so the model file never knows which backend runs and
the compiled graph carries only tensors and the layer's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from compilecore.config import EngineConfig
from compilecore.forward_context import get_forward_context
from passes import native_calls
from passes.native_calls import NativeCall


class AttentionImpl(Protocol):
    """What a runtime backend provides; bound to each layer with `Attention.bind`. A backend
    whose kernels a CPU graph can replay also has `native_calls(layer, q, k, v, output,
    attn_metadata)`: the C calls (`passes.native_calls.NativeCall`) its last `forward` made."""

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
    ) -> None: ...


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        engine_config: EngineConfig,
        prefix: str,
    ):
        super().__init__()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        self.prefix = self.layer_name = prefix
        registry = engine_config.compilation_config.static_forward_context
        if prefix in registry:
            raise ValueError(f"Duplicate layer name: {prefix}")
        registry[prefix] = self
        self.impl: AttentionImpl | None = None
        # Set by the runtime: [2, num_blocks, block_size, num_kv_heads, head_size].
        self.kv_cache: torch.Tensor | None = None

    def bind(self, impl: AttentionImpl, kv_cache: torch.Tensor | None = None) -> None:
        self.impl, self.kv_cache = impl, kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        output = torch.empty(
            q.shape[0], self.num_heads * self.head_size, dtype=q.dtype, device=q.device
        )
        torch.ops.compilecore.unified_attention_with_output(q, k, v, output, self.layer_name)
        return output

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}"


def unified_attention_with_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    ctx = get_forward_context()
    layer = ctx.no_compile_layers[layer_name]
    if layer.impl is None:
        raise RuntimeError(
            f"attention layer {layer_name} has no backend: the runtime must bind one "
            "(Attention.bind) before running the model"
        )
    layer.impl.forward(layer, q, k, v, output, ctx.attn_metadata)


def _native_calls(args: tuple, out: None) -> Sequence[NativeCall] | None:
    """The op's declared entry: the C calls its backend made for this step (a backend
    declares them with `native_calls`), or None where it ran Python."""
    q, k, v, output, layer_name = args
    ctx = get_forward_context()
    layer = ctx.no_compile_layers[layer_name]
    calls = getattr(layer.impl, "native_calls", None)
    return None if calls is None else calls(layer, q, k, v, output, ctx.attn_metadata)


def _fake_unified_attention_with_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    return None


# Registered through `torch.library.Library` rather than the `custom_op` decorator: the
# decorator's Python wrapper costs ~8 us a call, 30 times a decode step (docs/kernel-choices.md,
# Library registration).
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define(
    "unified_attention_with_output(Tensor q, Tensor k, Tensor v, Tensor(a!) output, "
    "str layer_name) -> ()"
)
for _key in ("CPU", "CUDA"):
    _LIB.impl("unified_attention_with_output", unified_attention_with_output, _key)
torch.library.register_fake(
    "compilecore::unified_attention_with_output", _fake_unified_attention_with_output, lib=_LIB
)
native_calls.declare_entry("compilecore::unified_attention_with_output", _native_calls)
