"""Each fusion pass on a toy module (ops before/after, numerics vs the unfused graph),
the whole model's match counts, the verifier and the manager's uuid."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import passes.fuse_add_rms_norm as add_rms_module
from compilecore.testing import PassTestBackend, count_ops
from models.layers.layernorm import RMSNorm
from models.layers.rotary_embedding import RotaryEmbedding
from passes.base import GraphPass
from passes.config import AttentionShape, PassConfig, PassContext
from passes.fuse_add_rms_norm import AddRMSNormFusionPass
from passes.fuse_qkv_rope import QKVRoPEFusionPass
from passes.manager import PostGradPassManager
from passes.verifier import PassVerificationError

aten = torch.ops.aten
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


class AddRMSToy(nn.Module):
    """Two residual norms: the first's new residual is used later, the second's is not."""

    def __init__(self, hidden: int, eps1: float, eps2: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, hidden) * 0.2)
        self.w2 = nn.Parameter(torch.randn(hidden, hidden) * 0.2)
        self.norm1, self.norm2 = RMSNorm(hidden, eps1), RMSNorm(hidden, eps2)
        with torch.no_grad():
            self.norm1.weight.uniform_(0.5, 1.5)
            self.norm2.weight.uniform_(0.5, 1.5)

    def forward(self, x, residual):
        h, residual = self.norm1(x @ self.w1, residual)
        h, _ = self.norm2(h @ self.w2, residual)
        return h


class QKVRoPEToy(nn.Module):
    def __init__(self, heads: int, kv_heads: int, head_dim: int, hidden: int = 32):
        super().__init__()
        self.sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.w = nn.Parameter(torch.randn(hidden, sum(self.sizes)) * 0.2)
        self.rope = RotaryEmbedding(head_dim, head_dim, 64, 10000.0)

    def forward(self, x, positions):
        q, k, v = (x @ self.w).split(self.sizes, dim=-1)
        q, k = self.rope(positions, q, k)
        return q * 2.0, k + 1.0, v * 3.0


def _run(module, backend, *inputs, dynamic: bool = True):
    for t in inputs:
        if dynamic:
            torch._dynamo.decorators.mark_unbacked(t, 0)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        return compiled(*inputs), module(*inputs)


def _close(got, want, dtype):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        scale = w.float().abs().max().item()
        assert (g.float() - w.float()).abs().max().item() <= TOL[dtype] * max(scale, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [(1e-5, 1e-6), (1e-6, 1e-6)])
def test_add_rms_norm_fusion(dtype, eps):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = AddRMSToy(32, *eps).to(dtype)
    backend = PassTestBackend(AddRMSNormFusionPass())
    got, want = _run(
        module, backend, torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    )
    assert count_ops(backend.graph_before, aten.rsqrt) == 2
    assert count_ops(backend.graph_before, torch.ops.compilecore.fused_add_rms_norm) == 0
    assert count_ops(backend.graph_after, aten.rsqrt) == 0
    assert count_ops(backend.graph_after, torch.ops.compilecore.fused_add_rms_norm) == 2
    assert backend.matches("fuse_add_rms_norm") == 2
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (2, 2, 8), (6, 1, 32)])
def test_qkv_rope_fusion(dtype, heads, kv_heads, head_dim):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = QKVRoPEToy(heads, kv_heads, head_dim).to(dtype)
    backend = PassTestBackend(QKVRoPEFusionPass([AttentionShape(heads, kv_heads, head_dim)]))
    x, positions = torch.randn(7, 32, dtype=dtype), torch.randint(0, 64, (7,))
    got, want = _run(module, backend, x, positions)
    assert count_ops(backend.graph_before, aten.split_with_sizes) == 1
    assert count_ops(backend.graph_before, aten.cat) == 2
    assert count_ops(backend.graph_after, aten.split_with_sizes) == 0
    assert count_ops(backend.graph_after, aten.cat) == 0
    assert count_ops(backend.graph_after, torch.ops.compilecore.fused_qkv_rope) == 1
    _close(got, want, dtype)


def test_qkv_rope_pattern_needs_the_right_shape():
    torch._dynamo.reset()
    module = QKVRoPEToy(4, 2, 16)
    backend = PassTestBackend(QKVRoPEFusionPass([AttentionShape(4, 4, 16)]))
    _run(module, backend, torch.randn(3, 32), torch.arange(3))
    assert backend.matches("fuse_qkv_rope") == 0


class BreakingPass(GraphPass):
    """Deliberately wrong: turns the first add into a subtraction."""

    name = "breaking_pass"

    def __call__(self, graph):
        for node in graph.nodes:
            if node.target is aten.add.Tensor:
                node.target = aten.sub.Tensor
                return 1
        return 0


def test_verifier_names_a_pass_that_changes_results():
    torch._dynamo.reset()
    module = AddRMSToy(16, 1e-5, 1e-5)
    backend = PassTestBackend(BreakingPass(), verify=True)
    with pytest.raises(Exception, match="pass breaking_pass on .*: output 0 differs") as info:
        _run(module, backend, torch.randn(4, 16), torch.randn(4, 16))
    assert isinstance(info.value, PassVerificationError) or "PassVerificationError" in repr(
        info.value
    )


class NaNPass(GraphPass):
    """Deliberately wrong in the way a tolerance check misses: the first add's result
    times NaN (every comparison with NaN is False)."""

    name = "nan_pass"

    def __call__(self, graph):
        for node in graph.nodes:
            if node.target is aten.add.Tensor:
                with graph.inserting_after(node):
                    nan = graph.call_function(aten.mul.Tensor, (node, float("nan")))
                node.replace_all_uses_with(nan, delete_user_cb=lambda u, new=nan: u is not new)
                return 1
        return 0


def test_verifier_rejects_a_pass_that_produces_nan():
    torch._dynamo.reset()
    backend = PassTestBackend(NaNPass(), verify=True)
    with pytest.raises(Exception, match="pass nan_pass on .*: output 0 NaN at"):
        _run(AddRMSToy(16, 1e-5, 1e-5), backend, torch.randn(4, 16), torch.randn(4, 16))


def test_verifier_accepts_a_correct_fusion():
    torch._dynamo.reset()
    backend = PassTestBackend(AddRMSNormFusionPass(), verify=True)
    _run(AddRMSToy(16, 1e-5, 1e-6), backend, torch.randn(4, 16), torch.randn(4, 16))
    assert backend.matches("fuse_add_rms_norm") == 2


# -- uuid -------------------------------------------------------------------------------
def _manager(**switches) -> PostGradPassManager:
    shapes = [AttentionShape(4, 2, 16)]
    return PostGradPassManager(PassConfig(**switches), PassContext("cpu", shapes))


def test_uuid_stable_within_and_across_processes():
    on = {"fuse_add_rms_norm": True, "fuse_qkv_rope": True}
    assert _manager(**on).uuid() == _manager(**on).uuid()
    code = (
        "from passes.config import *; from passes.manager import PostGradPassManager as M;"
        "print(M(PassConfig(fuse_add_rms_norm=True, fuse_qkv_rope=True),"
        " PassContext('cpu', [AttentionShape(4, 2, 16)])).uuid())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _manager(**on).uuid()


def test_uuid_changes_with_a_switch_or_a_shape():
    base = _manager(fuse_add_rms_norm=True)
    assert base.uuid() != _manager(fuse_add_rms_norm=False).uuid()
    other = PostGradPassManager(
        PassConfig(fuse_add_rms_norm=True), PassContext("cpu", [AttentionShape(8, 2, 16)])
    )
    assert (
        _manager(fuse_add_rms_norm=True, fuse_qkv_rope=True).uuid()
        != PostGradPassManager(
            PassConfig(fuse_add_rms_norm=True, fuse_qkv_rope=True), other.context
        ).uuid()
    )


def test_uuid_changes_when_a_pass_is_edited(tmp_path):
    source = Path(add_rms_module.__file__).read_text()
    edited = tmp_path / "edited_add_rms.py"
    edited.write_text(
        source.replace("_EPS_PLACEHOLDER = 1.2345e-7", "_EPS_PLACEHOLDER = 1.2346e-7")
    )
    spec = importlib.util.spec_from_file_location("edited_add_rms", edited)
    module = importlib.util.module_from_spec(spec)
    sys.modules["edited_add_rms"] = module
    spec.loader.exec_module(module)
    assert module.AddRMSNormFusionPass().uuid() != AddRMSNormFusionPass().uuid()
    assert AddRMSNormFusionPass().uuid() == AddRMSNormFusionPass().uuid()


def test_uuid_follows_the_ops_modules_a_pass_reaches_through_imports():
    """The dequantize decomposition traces `dequantize_q4_ref`, which calls the K-quants'
    layouts in `passes.ops.quant_layout` (imported by `passes.ops.quantized`): an edit
    there must change the pass's key, or a compile cache serves code traced from the old
    layout (it did: a Q5_K embedding kept a stale unpacking)."""
    from passes.decompose_dequantize import DecomposeDequantizePass
    from passes.ops import quant_layout

    names = {m.__name__ for m in DecomposeDequantizePass().source_objects()}
    assert {"passes.ops.quantized", quant_layout.__name__} <= names
    assert "passes.ops.qkv_rope" not in names  # not reached: no spurious misses


class LinearToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 32) * 0.2)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w).relu()


@pytest.mark.parametrize("rows, fused", [(1, True), (4, True), (8, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_to_reduction_only_for_small_static_batches(rows, fused, dtype):
    from passes.gemv_to_reduction import GemvToReductionPass

    torch._dynamo.reset()
    module = LinearToy().to(dtype)
    backend = PassTestBackend(GemvToReductionPass(max_m=4))
    got, want = _run(module, backend, torch.randn(rows, 32, dtype=dtype), dynamic=False)
    assert count_ops(backend.graph_before, aten.mm) == 1
    assert count_ops(backend.graph_after, aten.mm) == (0 if fused else 1)
    assert count_ops(backend.graph_after, aten.sum) == (1 if fused else 0)
    _close(got, want, dtype)


def test_gemv_to_reduction_leaves_symbolic_batches_alone():
    from passes.gemv_to_reduction import GemvToReductionPass

    torch._dynamo.reset()
    backend = PassTestBackend(GemvToReductionPass(max_m=4))
    _run(LinearToy(), backend, torch.randn(1, 32), dynamic=True)  # unbacked batch size
    assert backend.matches("gemv_to_reduction") == 0
