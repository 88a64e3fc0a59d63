"""The `onednn_linear` pass and its op: CPU GEMMs with 16-bit weights through oneDNN on a
weight reordered once. The oracle is `torch.mm` on the same tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilecore import testing
from passes.onednn_linear import OneDnnLinearPass
from passes.ops import onednn_linear

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="no oneDNN in this torch")
aten = torch.ops.aten


def linear_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w).relu()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * max(scale, 1.0)


@testing.settings(max_examples=30)
@given(
    m=st.integers(1, 80), k=st.sampled_from([16, 40, 64, 576]), n=st.sampled_from([8, 24, 96]),
    dtype=st.sampled_from(onednn_linear.supported_dtypes() or [torch.bfloat16]),
)  # fmt: skip
def test_op_equals_mm(m, k, n, dtype):
    x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) * 0.1).to(dtype)
    _close(torch.ops.compilecore.onednn_mm(x, w), torch.mm(x, w.t()))
    _close(torch.ops.compilecore.onednn_mm(x[:, : k // 2 * 2], w[:, : k // 2 * 2]),
           torch.mm(x[:, : k // 2 * 2], w[:, : k // 2 * 2].t()))  # fmt: skip


def test_reordered_copy_follows_the_weight():
    from passes.ops.onednn_linear import _PACKED, SMALL_M_ROWS

    # More rows than the row-streaming kernel takes: oneDNN on the reordered copy.
    x, w = torch.randn(SMALL_M_ROWS + 4, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    first = torch.ops.compilecore.onednn_mm(x, w)
    with torch.no_grad():
        w.copy_(torch.randn(16, 32).bfloat16())  # in place: same storage, new version
    _close(torch.ops.compilecore.onednn_mm(x, w), torch.mm(x, w.t()))
    w.data = torch.randn(16, 32).bfloat16()  # new storage behind the same tensor
    _close(torch.ops.compilecore.onednn_mm(x, w), torch.mm(x, w.t()))
    assert not torch.equal(first, torch.ops.compilecore.onednn_mm(x, w))
    ident = id(w)
    assert ident in _PACKED
    del w
    assert ident not in _PACKED  # the copy goes with its weight


@pytest.mark.parametrize("dtype, matched", [(torch.bfloat16, 1), (torch.float32, 0)])
def test_pass_rewrites_16bit_gemms_only(dtype, matched):
    x, w = torch.randn(6, 32).to(dtype), (torch.randn(24, 32) * 0.2).to(dtype)
    backend = testing.check_pass(OneDnnLinearPass(), linear_relu, x, w)
    assert backend.matches("onednn_linear") == matched
    assert testing.count_ops(backend.graph_after, aten.mm) == 1 - matched
    assert backend.ops_after().get("compilecore.onednn_mm", 0) == matched


@pytest.mark.slow
def test_compiled_bf16_model_with_the_pass_matches_eager():
    from runtime.testing import compiled_eager_pair
    from tests.helpers import llama_config

    config = llama_config(num_hidden_layers=2)
    compiled, eager = compiled_eager_pair(config, dtype=torch.bfloat16)
    for n in (3, 17, 2):  # the symbolic-size code, where the pass applies
        ids = torch.randint(0, config.vocab_size, (n,))
        testing.assert_compiled_matches_eager(compiled, eager, ids, torch.arange(n), rtol=3e-2)


def test_small_batches_take_the_row_streaming_kernel():
    from passes.ops.onednn_linear import SMALL_M_ROWS, _small_m_kernel, _small_m_mm

    if _small_m_kernel() is None:
        pytest.skip("no AVX512-BF16 here: oneDNN takes every size")
    w = (torch.randn(40, 96) * 0.1).bfloat16()
    for m in range(1, SMALL_M_ROWS + 1):
        x = torch.randn(m, 96).bfloat16()
        got = _small_m_mm(x, w)
        assert got is not None
        _close(got, torch.mm(x, w.t()))
    assert _small_m_mm(torch.randn(SMALL_M_ROWS + 1, 96).bfloat16(), w) is None
