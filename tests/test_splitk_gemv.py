"""The split-K GEMV (passes/splitk_gemv.py, passes/ops/gemv_partials.py): the Triton
kernel under TRITON_INTERPRET=1 against the reference's partial sums, the pass on a toy
linear layer against the unfused graph (Inductor fusing the sum into the consumer), and
on CUDA for real (GPU-marked)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from compilecore import testing
from compilecore.testing import PassTestBackend, count_ops
from passes.ops.gemv_partials import (
    GemvTile,
    choose_splits,
    gemv_partials_ref,
    gemv_partials_triton,
    split_bounds,
)

aten = torch.ops.aten
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set without CUDA)"
)


@st.composite
def products(draw):
    m = draw(st.integers(1, 4))
    n = draw(st.integers(1, 40))
    k = draw(st.integers(1, 700))
    splits = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    return x, w, splits


@interpreted
@testing.settings(max_examples=25)
@given(case=products(), block_k=st.sampled_from([32, 256]))
def test_kernel_partials_equal_the_reference(case, block_k):
    """Any 1-4 rows, N, K and split count (splits past K's end hold zeros): each split's
    fp32 partial sum equals the reference's over the same K range, and they add up to
    the product."""
    x, w, splits = case
    tile = GemvTile(block_n=16, block_k=block_k, num_warps=4)
    got = gemv_partials_triton(x, w, splits, tile)
    bounds = split_bounds(x.shape[1], splits, block_k)
    want = torch.stack([x[:, a:b].float() @ w[:, a:b].float().t() for a, b in bounds])
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    full = x.float() @ w.float().t()
    torch.testing.assert_close(got.sum(0), full, rtol=1e-5, atol=1e-3)


@testing.settings(max_examples=200)
@given(n=st.integers(1, 200_000), k=st.integers(1, 16384), block_k=st.sampled_from([64, 256]))
def test_splits_cover_k_once_in_whole_tiles(n, k, block_k):
    splits = choose_splits(n, k)
    assert 1 <= splits <= 16 and (splits == 1 or k // splits >= 256)
    bounds = split_bounds(k, splits, block_k)
    assert bounds[0][0] == 0 and bounds[-1][1] == k
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(bounds, bounds[1:]))
    assert all((b - a) % block_k == 0 for a, b in bounds[:-1] if b < k)


class LinearToy(nn.Module):
    def __init__(self, n: int = 48, k: int = 1024):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, k) * 0.05)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w).relu()


@pytest.mark.parametrize("rows, fused", [(1, True), (4, True), (5, False)])
def test_pass_rewrites_small_static_batches_only(rows, fused):
    """At 1-4 static rows the product becomes the partials op and a sum (the reference
    op on CPU), equal to the unfused graph; at 5 rows, or a symbolic count, untouched."""
    from passes.splitk_gemv import SplitKGemvPass

    torch._dynamo.reset()
    module = LinearToy()
    backend = PassTestBackend(SplitKGemvPass())
    x = torch.randn(rows, 1024)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got, want = compiled(x), module(x)
    assert count_ops(backend.graph_after, aten.mm) == (0 if fused else 1)
    ops = count_ops(backend.graph_after, torch.ops.compilecore.gemv_partials)
    assert ops == (1 if fused else 0)
    assert backend.matches("splitk_gemv") == (1 if fused else 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert choose_splits(48, 1024) == 2  # 3 blocks of 16 rows: K split in two halves
    torch.testing.assert_close(
        gemv_partials_ref(x, module.w.detach(), 2).sum(0), x @ module.w.detach().t()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (2048, 8192)])
@pytest.mark.parametrize("rows", [1, 3])
def test_kernel_on_cuda(n, k, rows):
    x = torch.randn(rows, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    splits = choose_splits(n, k)
    got = gemv_partials_triton(x, w, splits).sum(0)
    torch.testing.assert_close(got, x.float() @ w.float().t(), rtol=1e-3, atol=1e-2)
