"""Who this process is in the parallel world: tensor- and pipeline-parallel groups.

Layers ask here for their rank and size so that each one holds only its own slice. The
world is a single process until `init_parallel_state` is called with real
torch.distributed groups (the distributed runtime does that per worker).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GroupCoordinator:
    rank_in_group: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when world_size > 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        # Functional collective: Dynamo traces it, so passes can see and fuse it.
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed._functional_collectives as funcol

        gathered = funcol.all_gather_tensor(x.contiguous(), 0, self.group)
        chunks = gathered.chunk(self.world_size, dim=0)
        return torch.cat(chunks, dim=dim)


_TP = GroupCoordinator()
_PP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)


def init_parallel_state(tp: GroupCoordinator, pp: GroupCoordinator) -> None:
    global _TP, _PP
    _TP, _PP = tp, pp


@contextmanager
def parallel_state(tp: GroupCoordinator, pp: GroupCoordinator) -> Iterator[None]:
    """Temporarily take a place in the parallel world (building one stage's model)."""
    prev = (_TP, _PP)
    init_parallel_state(tp, pp)
    try:
        yield
    finally:
        init_parallel_state(*prev)
