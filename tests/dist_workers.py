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


def finish_gloo() -> None:
    """Ends a worker whose results are written: every rank past its collectives, then out
    without tearing gloo down. A rank destroying its group while its peer's sockets close
    aborted once in CI ("terminate called without an active exception", SIGABRT in the
    gloo teardown after the results were written); the teardown is not what these tests
    test, and the engine's own process groups are tested in test_distributed.py."""
    dist.barrier()
    os._exit(0)


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
    finish_gloo()


class NoPPForCausalLM(torch.nn.Module):
    """A registered architecture that does not declare SupportsPP."""

    def __init__(self, *, engine_config, prefix: str = ""):
        super().__init__()


def screened_head_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """The batch-1 LM head of a vocabulary that does not divide by the TP size (the last
    rank holds a padding row), screened for an argmax, on hidden states that make every
    real logit negative; writes the gathered logits' argmax and the exact one."""
    import torch.nn.functional as F

    from compilecore.parallel_state import init_model_parallel
    from models.layers.logits_processor import LogitsProcessor
    from models.layers.vocab_embedding import ParallelLMHead

    init_gloo(rank, world_size, port)
    init_model_parallel(world_size, 1)
    vocab, hidden = 321, 128
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(hidden, generator=gen)
    weight = (base + 0.3 * torch.randn(vocab, hidden, generator=gen)).bfloat16()
    head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
    head.weight_loader(head.weight, weight)
    processor = LogitsProcessor(vocab, small_batch_gemv=torch.ops.compilecore.gemv_logits)
    results = []
    for scale in (0.05, 0.2, 1.0):
        h = (-scale * base + 0.02 * torch.randn(hidden, generator=gen)).bfloat16()[None]
        exact = F.linear(h.double(), weight.double())[0]
        processor.set_argmax_only(True)
        got = processor(head, h)[0]
        top2 = exact.topk(2).values
        margin = float(top2[0] - top2[1])
        results.append({"argmax": int(got.argmax()), "exact": int(exact.argmax()),
                        "max_exact": float(top2[0]), "margin": margin})  # fmt: skip
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finish_gloo()
