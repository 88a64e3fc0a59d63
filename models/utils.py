"""Model-file helpers with vLLM's names: prefixes, pipeline-stage layer lists, and the
tensors that flow between pipeline stages."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from compilecore.parallel_state import get_pp_group


def maybe_prefix(prefix: str, name: str) -> str:
    """`prefix.name`, or just `name` at the root (prefix "")."""
    return f"{prefix}.{name}" if prefix else name


def extract_layer_index(prefix: str) -> int:
    """The layer number in a prefix such as `model.layers.3.self_attn.attn`."""
    numbers = [int(part) for part in prefix.split(".") if re.fullmatch(r"\d+", part)]
    if len(numbers) != 1:
        raise ValueError(f"prefix {prefix!r} must contain exactly one layer index, got {numbers}")
    return numbers[0]


class PPMissingLayer(nn.Identity):
    """Stands where another pipeline stage owns the layer, so names stay the same."""

    def forward(self, *args, **kwargs):  # noqa: D401 - identity on the first input
        return args[0] if args else next(iter(kwargs.values()))


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """This stage's `[start, end)` of layers; earlier stages take the remainder."""
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    end = start + base + (1 if pp_rank < extra else 0)
    return start, end


def make_layers(
    num_layers: int, layer_fn: Callable[[str], nn.Module], prefix: str
) -> tuple[int, int, nn.ModuleList]:
    """Real layers only in this pipeline stage's range; `PPMissingLayer` elsewhere."""
    pp = get_pp_group()
    start, end = get_pp_indices(num_layers, pp.rank_in_group, pp.world_size)
    layers = [
        layer_fn(maybe_prefix(prefix, str(i))) if start <= i < end else PPMissingLayer()
        for i in range(num_layers)
    ]
    return start, end, nn.ModuleList(layers)


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether a checkpoint weight belongs to a layer that another stage owns."""
    for module_name, module in model.named_modules():
        if isinstance(module, PPMissingLayer) and name.startswith(module_name + "."):
            return True
    return False


@dataclass
class IntermediateTensors:
    """What a pipeline stage that is not the last hands to the next one."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def items(self):
        return self.tensors.items()

    def __len__(self) -> int:
        return len(self.tensors)


def make_empty_intermediate_tensors_factory(keys: list[str], hidden_size: int):
    def make_empty(batch_size: int, dtype: torch.dtype, device: torch.device):
        return IntermediateTensors(
            {k: torch.zeros(batch_size, hidden_size, dtype=dtype, device=device) for k in keys}
        )

    return make_empty
