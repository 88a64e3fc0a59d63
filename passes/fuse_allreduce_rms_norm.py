"""All-reduce + residual add + RMSNorm -> `compilecore.fused_allreduce_add_rms_norm`
(tensor parallelism only: the row-parallel o_proj/down_proj partial sums).

Unfused:

    r   = wait_tensor(all_reduce(x, "sum", group))
    s   = add(r, residual)
    out = <RMSNorm of s, as in fuse_add_rms_norm>

Fused:

    out, s = compilecore.fused_allreduce_add_rms_norm(x, residual, weight, eps, group)

Runs before the add+RMSNorm fusion, which would otherwise take the add and norm first.
Per rank in a Llama with L layers: 2L sites (every norm that follows o_proj or down_proj,
including the final norm).
"""

from __future__ import annotations

import torch

from passes.base import PatternPass
from passes.fuse_add_rms_norm import register_norm_patterns
from passes.ops.add_rms_norm import fused_add_rms_norm_ref


class AllReduceRMSNormFusionPass(PatternPass):
    name = "fuse_allreduce_rms_norm"
    depends_on = ("passes.fuse_add_rms_norm", "passes.ops.add_rms_norm")

    def __init__(self, group_name: str):
        self.group_name = group_name
        super().__init__()

    def config(self) -> dict:
        return {"group": self.group_name}

    def register(self) -> None:
        group = self.group_name

        def search(x, residual, weight, eps):
            reduced = torch.ops._c10d_functional.all_reduce.default(x, "sum", group)
            reduced = torch.ops._c10d_functional.wait_tensor.default(reduced)
            out, summed = fused_add_rms_norm_ref(reduced, residual, weight, eps)
            return out, summed

        def replace(x, residual, weight, eps):
            op = torch.ops.compilecore.fused_allreduce_add_rms_norm.default
            out = op(x, residual, weight, eps, group)
            return out[0], out[1]

        register_norm_patterns(search, replace, self.patterns)
