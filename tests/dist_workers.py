"""Worker functions for multi-process tests (spawned: they must be importable)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def init_gloo(rank: int, world_size: int, port: int) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.manual_seed(1234)  # the same weights on every rank


def allreduce_fusion_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from compilecore.testing import PassTestBackend, count_ops
    from passes.fuse_allreduce_rms_norm import AllReduceRMSNormFusionPass
    from passes.ops.add_rms_norm import fused_add_rms_norm_ref

    init_gloo(rank, world_size, port)
    group = dist.group.WORLD
    w = torch.randn(16, 16) * 0.3
    norm_w = torch.rand(16) + 0.5

    def toy(x, residual):
        partial = x[:, rank * 8 : (rank + 1) * 8] @ w[rank * 8 : (rank + 1) * 8]  # row-parallel
        reduced = funcol.all_reduce(partial, "sum", group)
        out, new_residual = fused_add_rms_norm_ref(reduced, residual, norm_w, 1e-5)
        return out * 2.0, new_residual

    backend = PassTestBackend(AllReduceRMSNormFusionPass(group.group_name))
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    compiled = torch.compile(toy, backend=backend, fullgraph=True)
    got = compiled(x, residual)
    want = toy(x, residual)
    fused = torch.ops.compilecore.fused_allreduce_add_rms_norm
    result = {
        "matches": backend.matches("fuse_allreduce_rms_norm"),
        "fused_ops": count_ops(backend.graph_after, fused),
        "allreduce_before": count_ops(backend.graph_before, torch.ops._c10d_functional.all_reduce),
        "allreduce_after": count_ops(backend.graph_after, torch.ops._c10d_functional.all_reduce),
        "max_diff": max((g - w_).abs().max().item() for g, w_ in zip(got, want)),
        "full": (x @ w).sub(want[1] - residual).abs().max().item(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


class NoPPForCausalLM(torch.nn.Module):
    """A registered architecture that does not declare SupportsPP."""

    def __init__(self, *, engine_config, prefix: str = ""):
        super().__init__()
