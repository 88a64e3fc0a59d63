"""Vocabulary-parallel embedding and LM head: rank r holds rows [r*V/tp, (r+1)*V/tp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compilecore.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from models.layers.linear import ShapeMismatchError, copy_checked
from models.layers.quantization import (
    QuantFormat,
    QuantizationConfig,
    make_quantized_params,
    quant_fields,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.prefix = prefix
        dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # Pad so every rank holds the same number of rows; padded rows are never looked up
        # and their logits are cut off by the logits processor.
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        # Only a checkpoint stored quantized (GGUF) quantizes the embedding and the head.
        stored = quant_config is not None and not quant_config.quantize_at_load
        self.quant_format: QuantFormat | None = quant_config.format_for(prefix) if stored else None
        if self.quant_format is not None:
            self.quant_dtype = dtype  # what the looked-up rows are dequantized to
            make_quantized_params(self, self.quant_format, self.num_embeddings_per_partition,
                                  embedding_dim, self.weight_loader)  # fmt: skip
        else:
            self.weight = nn.Parameter(
                torch.empty(self.num_embeddings_per_partition, embedding_dim,
                            dtype=dtype),
                requires_grad=False,
            )  # fmt: skip
            self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # The weight (or a quantized field of it) or an LM head's bias: split by rows.
        full = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded.shape) != full:
            raise ShapeMismatchError(f"expected shape {full}, got {tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:rows], loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_format is None:
            return F.embedding(ids, self.weight)
        rows = [F.embedding(ids, f) for f in quant_fields(self)]  # each field's looked-up rows
        return self.quant_format.dequantize(rows, self.quant_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        out = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; its weight may be tied to the input embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bias: bool = False, **kw):
        super().__init__(num_embeddings, embedding_dim, **kw)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.num_embeddings_per_partition, dtype=kw.get("params_dtype")),
                requires_grad=False,
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        self.quant_format = embed_tokens.quant_format
        if self.quant_format is None:
            self.weight = embed_tokens.weight
            return self
        del self.weight
        for name in self.quant_format.names():
            self.register_parameter(name, getattr(embed_tokens, name))
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
