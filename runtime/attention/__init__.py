"""Attention backends the runtime binds to the model's attention layers."""

from runtime.attention.dense import DenseAttentionBackend
from runtime.attention.metadata import AttentionMetadata
from runtime.attention.torch_paged import TorchPagedAttentionBackend

__all__ = ["AttentionMetadata", "DenseAttentionBackend", "TorchPagedAttentionBackend"]
