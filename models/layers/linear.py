"""Tensor-parallel linear layers. Each holds only this rank's slice of the weight and
cuts that slice from the full checkpoint tensor in its own `weight_loader`.

Like vLLM's, every layer returns `(output, bias)`; `bias` is None unless `skip_bias_add`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compilecore.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from models.layers.quantization import (
    GROUPS_PER_SUPER,
    QuantFormat,
    QuantizationConfig,
    make_quantized_params,
    quant_fields,
    quantize,
)


class ShapeMismatchError(ValueError):
    pass


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ShapeMismatchError(f"expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} {numerator} is not divisible by tensor parallel size {denominator}"
        )
    return numerator // denominator


def _shard(loaded: torch.Tensor, dim: int, index: int, size: int, full: int) -> torch.Tensor:
    if loaded.shape[dim] != full:
        raise ShapeMismatchError(
            f"expected size {full} along dim {dim}, got shape {tuple(loaded.shape)}"
        )
    return loaded.narrow(dim, index * size, size)


def _shard_target(param: nn.Parameter, shard_id: object, offset: int, size: int) -> torch.Tensor:
    """Where shard `shard_id` goes in `param`: its rows of a fused parameter, or the whole
    of a parameter that holds that shard alone (a part kept in its own format)."""
    own = getattr(param, "shard_id", None)
    if own is None:
        return param.data.narrow(0, offset, size)
    if own != shard_id:
        raise ShapeMismatchError(f"shard {shard_id!r} given to the parameter of shard {own!r}")
    return param.data


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.quant_config = quant_config
        # The format of the fields this layer holds in place of `weight` (None: a float
        # weight, also while one waits to be quantized after loading).
        self.quant_format: QuantFormat | None = None
        # A fused layer whose parts are stored in different formats holds each part's
        # fields apart (named `qweight_<shard>`...): ((shard id, rows), format) per part.
        self.part_formats: tuple[tuple[tuple[object, int], QuantFormat], ...] | None = None
        self.skip_bias_add = skip_bias_add
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self._has_bias = bias

    def _shards(self) -> list[tuple[object, int]] | None:
        """A fused layer's parts: (shard id, rows on this rank) in output order."""
        return None

    def _make_params(self, out_features: int, in_features: int) -> None:
        fmt = self.quant_config.format_for(self.prefix) if self.quant_config else None
        parts = self.quant_config.parts.get(self.prefix) if self.quant_config else None
        if fmt is not None and self.quant_config.quantize_at_load:
            try:  # refused before any weight is read, not when this layer's arrives
                fmt.fields(out_features, in_features)
            except ValueError as e:
                raise ValueError(
                    f"quantization={self.quant_config.name!r} cannot hold {self.prefix} "
                    f"([{out_features}, {in_features}] on this rank): {e}; use a format "
                    "whose groups divide it (e.g. 'int4', groups of 32, or 'int8')"
                ) from None
        if parts is not None:
            self._make_part_params(parts, in_features)
        elif fmt is not None and not self.quant_config.quantize_at_load:
            make_quantized_params(self, fmt, out_features, in_features, self.weight_loader)
            self.quant_format = fmt
        else:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=self.params_dtype),
                requires_grad=False,
            )
            self.weight.weight_loader = self.weight_loader
        if self._has_bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=self.params_dtype), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _make_part_params(self, parts: tuple[QuantFormat, ...], in_features: int) -> None:
        shards = self._shards()
        if shards is None or len(shards) != len(parts):
            raise ValueError(f"{self.prefix}: {len(parts)} part formats for a layer with "
                             f"{len(shards or ())} parts")  # fmt: skip
        for (sid, rows), fmt in zip(shards, parts):
            for param in make_quantized_params(self, fmt, rows, in_features,
                                               self.weight_loader, f"_{sid}"):  # fmt: skip
                param.shard_id = sid  # holds this shard alone
        self.part_formats = tuple(zip(shards, parts))

    def _part_weights(self) -> list[torch.Tensor]:
        return [fmt.dequantize(quant_fields(self, fmt, f"_{sid}"), self.params_dtype)
                for (sid, _), fmt in self.part_formats]  # fmt: skip

    def linear_weight(self) -> torch.Tensor:
        """The weight as the product reads it: the float weight, or its dequantization."""
        if self.part_formats is not None:
            return torch.cat(self._part_weights())
        if self.quant_format is None:
            return self.weight
        return self.quant_format.dequantize(quant_fields(self), self.params_dtype)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight^T (+ bias). Parts held apart are multiplied apart (each its own
        `mm(x, dequantize(...)^T)` for the passes to rewrite) and concatenated, as vLLM's
        GGUF layers do with mixed shards."""
        if self.part_formats is None:
            return F.linear(x, self.linear_weight(), bias)
        outs, at = [], 0
        for ((_, rows), _), w in zip(self.part_formats, self._part_weights()):
            outs.append(F.linear(x, w, None if bias is None else bias[at : at + rows]))
            at += rows
        return torch.cat(outs, -1)

    def process_weights_after_loading(self) -> None:
        """Quantize the loaded float weight where the config asks for it at load."""
        config = self.quant_config
        fmt = config.format_for(self.prefix) if config and config.quantize_at_load else None
        if fmt is None or self.quant_format is not None:
            return
        fields = quantize(self.weight.data, fmt)
        del self.weight
        for name, value in fields.items():
            self.register_parameter(name, nn.Parameter(value, requires_grad=False))
        self.quant_format = fmt

    def extra_repr(self) -> str:
        quant = f", quant=q{self.quant_format.bits}" if self.quant_format else ""
        if self.part_formats:
            quant = ", quant=" + "+".join(f"q{fmt.bits}" for _, fmt in self.part_formats)
        return (
            f"in={self.input_size}, out={self.output_size}, "
            f"bias={self._has_bias}, tp={self.tp_size}{quant}"
        )


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self._make_params(output_size, input_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        return F.linear(x, self.linear_weight(), bias), (self.bias if self.skip_bias_add else None)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by columns (output features): rank r holds rows r of A^T."""

    def __init__(self, input_size: int, output_size: int, *, gather_output: bool = False, **kw):
        super().__init__(input_size, output_size, **kw)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self._make_params(self.output_size_per_partition, input_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        copy_checked(param.data, _shard(loaded, 0, self.tp_rank, size, self.output_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        out = self._product(x, bias)
        if self.gather_output:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out, (self.bias if self.skip_bias_add else None)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one GEMM (gate_up_proj).

    The checkpoint stores them apart; `weight_loader(param, w, shard_id)` places shard
    `shard_id` (an index into `output_sizes`) at its offset within this rank's slice.
    """

    def __init__(self, input_size: int, output_sizes: list[int], **kw):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, get_tensor_model_parallel_world_size(), "output size")
        super().__init__(input_size, sum(output_sizes), **kw)

    def _shards(self) -> list[tuple[object, int]]:
        return [(i, size // self.tp_size) for i, size in enumerate(self.output_sizes)]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:  # already merged in the checkpoint
            return super().weight_loader(param, loaded)
        full = self.output_sizes[shard_id]
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        copy_checked(_shard_target(param, shard_id, offset, size),
                     _shard(loaded, 0, self.tp_rank, size, full))  # fmt: skip


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one GEMM, split by heads across ranks.

    KV heads are partitioned when there are at least as many as ranks and replicated
    otherwise (each group of `tp_size / total_num_kv_heads` ranks shares one KV head).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        **kw,
    ):
        tp_size = get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tensor parallel size {tp_size} must be a multiple of the number of "
                    f"KV heads {total_num_kv_heads} to replicate them"
                )
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, **kw)

    def _shards(self) -> list[tuple[object, int]]:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        return [("q", q_size), ("k", kv_size), ("v", kv_size)]

    def _shard_layout(self, shard_id: str) -> tuple[int, int, int, int]:
        """(offset in this rank's slice, size, index of this rank's shard, full size)."""
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            return 0, q_size, self.tp_rank, self.total_num_heads * self.head_size
        kv_index = self.tp_rank // self.num_kv_head_replicas
        full = self.total_num_kv_heads * self.head_size
        offset = q_size if shard_id == "k" else q_size + kv_size
        return offset, kv_size, kv_index, full

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint with a fused qkv tensor
            q, k, v = loaded.split(
                [
                    self.total_num_heads * self.head_size,
                    *[self.total_num_kv_heads * self.head_size] * 2,
                ]
            )
            for sid, part in zip("qkv", (q, k, v)):
                self.weight_loader(param, part, sid)
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, size, index, full = self._shard_layout(shard_id)
        copy_checked(_shard_target(param, shard_id, offset, size),
                     _shard(loaded, 0, index, size, full))  # fmt: skip


class RowParallelLinear(LinearBase):
    """Y = X A with A split by rows (input features); partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, *, reduce_results: bool = True, **kw):
        super().__init__(input_size, output_size, **kw)
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self._make_params(output_size, self.input_size_per_partition)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: whole, added once after the reduction
            return default_weight_loader(param, loaded)
        size = param.shape[1]  # of the weight's columns, or of a quantized field's
        fmt = self.quant_format
        if fmt is not None and fmt.compact and param is not self.qweight:
            return copy_checked(param.data, self._compact_columns(loaded, size))
        copy_checked(param.data, _shard(loaded, 1, self.tp_rank, size, size * self.tp_size))

    def _compact_columns(self, loaded: torch.Tensor, size: int) -> torch.Tensor:
        """This rank's columns of compact scales [G bytes | G/per fp32]: its sub-block bytes
        and its super-blocks' 4 bytes each (the format makes them whole super-blocks)."""
        per, full = GROUPS_PER_SUPER[loaded.dtype], size * self.tp_size
        groups = size * per // (per + 4)
        if loaded.shape[1] != full:
            raise ShapeMismatchError(f"expected {full} columns, got shape {tuple(loaded.shape)}")
        sub = loaded[:, : groups * self.tp_size].narrow(1, self.tp_rank * groups, groups)
        sup_bytes = groups // per * 4
        sup = loaded[:, groups * self.tp_size :].narrow(1, self.tp_rank * sup_bytes, sup_bytes)
        return torch.cat([sub, sup], 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = F.linear(x, self.linear_weight())
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        return out, (self.bias if self.skip_bias_add else None)
