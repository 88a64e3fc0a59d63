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
    ranks: tuple[int, ...] = (0,)  # global ranks of the members, by rank in group

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

        # all_gather_single replaces all_gather_tensor from torch 2.13 on.
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        gathered = gather(x.contiguous(), 0, self.group)
        chunks = gathered.chunk(self.world_size, dim=0)
        return torch.cat(chunks, dim=dim)

    # Point-to-point between pipeline stages, outside the compiled graph. Peers are given
    # by their rank in this group; both sides know the tensors' shapes from the step plan.
    def send_tensors(self, tensors: dict[str, torch.Tensor], dst: int) -> None:
        import torch.distributed as dist

        for name in sorted(tensors):
            dist.send(tensors[name].contiguous(), self.ranks[dst])

    def recv_tensors(self, tensors: dict[str, torch.Tensor], src: int) -> None:
        import torch.distributed as dist

        for name in sorted(tensors):
            dist.recv(tensors[name], self.ranks[src])


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


def world_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Make the TP and PP groups of an initialized world (every rank calls this, in the
    same order). Global rank = pp_rank * tp_size + tp_rank."""
    import torch.distributed as dist

    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp * pp:
        raise ValueError(f"world size {world} != tensor_parallel_size {tp} x pipeline {pp}")
    mine: dict[str, GroupCoordinator] = {}
    layouts = [
        ("tp", [[s * tp + t for t in range(tp)] for s in range(pp)]),
        ("pp", [[s * tp + t for s in range(pp)] for t in range(tp)]),
    ]
    for kind, groups in layouts:
        for ranks in groups:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = GroupCoordinator(ranks.index(rank), len(ranks), group, tuple(ranks))
    init_parallel_state(mine["tp"], mine["pp"])


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
