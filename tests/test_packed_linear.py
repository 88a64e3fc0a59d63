"""The `packed_linear` pass and its op: CPU GEMMs with 16-bit weights on a copy of the
weight packed once, through our kernel (`packed_mm.cpp`) or oneDNN. The oracle is the fp32
product of the same bf16 values, rounded once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilecore import cpu_graph, testing
from passes.ops import derived, onednn_shim, packed_linear
from passes.packed_linear import PackedLinearPass

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="no 16-bit GEMMs here")
aten = torch.ops.aten
ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w).relu()


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within a 16-bit rounding (and fp32 summation order) of the exact product."""
    want = (x.float() @ w.float().t()).to(got.dtype).float()
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * max(scale, 1.0))


@pytest.fixture(params=["own", "onednn", "widened"])
def kernel(request, monkeypatch):
    """Each test of the op runs on each kernel (oneDNN's where ours would take bf16; MKL's
    fp32 GEMM on a widened copy, which runs on every CPU)."""
    monkeypatch.setattr(packed_linear, "widens", lambda dtype: request.param == "widened")
    if request.param == "own":
        if packed_linear._kernel() is None:
            pytest.skip("no AVX512-BF16 here: oneDNN takes bf16")
        # on an AMX CPU oneDNN takes bf16, but ours still builds: test it there too
        monkeypatch.setattr(packed_linear, "uses_own_kernel", lambda dtype: dtype == torch.bfloat16)
    if request.param == "onednn":
        if not ONEDNN_BF16:
            pytest.skip("no bf16 oneDNN here")
        monkeypatch.setattr(packed_linear, "uses_own_kernel", lambda dtype: False)
    if request.param == "widened":
        monkeypatch.setattr(packed_linear, "uses_own_kernel", lambda dtype: False)
    derived.forget("packed_mm")  # copies prepared for the other kernel
    yield request.param
    derived.forget("packed_mm")


@testing.settings(max_examples=20)
@given(m=st.integers(1, 40), n=st.sampled_from([8, 24, 100]), seed=st.integers(0, 2**16))
def test_op_with_a_bias_equals_addmm(kernel, m, n, seed):
    """Qwen2's q/k/v: the bias added in fp32 before the one rounding, as addmm does (to
    the last bit but the fp32 summation order); column blocks with a tail."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, 40, generator=g).bfloat16(), torch.randn(n, 40, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() * 4
    got = torch.ops.compilecore.packed_mm(x, w, b)
    want = torch.addmm(b, x, w.t())
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)


@testing.settings(max_examples=40)
@given(
    m=st.integers(1, 80), k=st.sampled_from([16, 33, 40, 64, 576]),
    n=st.sampled_from([8, 24, 96, 100]),
)  # fmt: skip
def test_op_equals_the_exact_product(kernel, m, k, n):
    """Row tiles of 16 and their remainder, odd K, column blocks with a tail, and x rows
    with a stride (a view of wider rows)."""
    x, w = torch.randn(m, k + 3).bfloat16(), (torch.randn(n, k) * 0.1).bfloat16()
    _close(torch.ops.compilecore.packed_mm(x[:, :k], w), x[:, :k], w)
    _close(torch.ops.compilecore.packed_mm(x[:, :k].contiguous(), w), x[:, :k], w)


def test_packed_copy_follows_the_weight(kernel):
    x, w = torch.randn(12, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    first = torch.ops.compilecore.packed_mm(x, w)
    with torch.no_grad():
        w.copy_(torch.randn(16, 32).bfloat16())  # in place: same storage, new version
    _close(torch.ops.compilecore.packed_mm(x, w), x, w)
    w.data = torch.randn(16, 32).bfloat16()  # new storage behind the same tensor
    _close(torch.ops.compilecore.packed_mm(x, w), x, w)
    assert not torch.equal(first, torch.ops.compilecore.packed_mm(x, w))
    ident = id(w)
    # the widened copy lives in a scratch for one call: nothing is kept to go stale
    assert (derived.current(w, "packed_mm") is None) == (kernel == "widened")
    del w
    assert ident not in derived._COPIES  # the copy goes with its weight


def test_products_are_recorded_into_cpu_graphs(kernel, tmp_path):
    """A capture records the C call the op declares (ours, or oneDNN's through
    AOTInductor's shim): a replay on new input values equals the op called again, also
    outside the inference mode the engine captured it in. An input the kernel cannot
    read in place (a column stride) is refused, not copied behind the capture's back."""
    if kernel == "onednn" and onednn_shim.shim_call() is None:
        pytest.skip("this torch exports no AOTInductor shim for oneDNN's linear")
    w = (torch.randn(40, 96) * 0.1).bfloat16()
    x = torch.randn(20, 96).bfloat16()
    if kernel == "widened":  # torch's GEMMs are no C call a graph can replay: refused
        with pytest.raises(cpu_graph.CpuGraphUnsupported, match="native bf16 GEMM"):
            cpu_graph.capture(lambda: torch.ops.compilecore.packed_mm(x, w), tmp_path)
        return
    with torch.inference_mode():  # the output is an inference tensor, as in the engine
        out, graph = cpu_graph.capture(lambda: torch.ops.compilecore.packed_mm(x, w), tmp_path)
    assert graph.num_calls == 1
    _close(out, x, w)
    x.copy_(torch.randn_like(x))
    assert torch.equal(graph.replay(), torch.ops.compilecore.packed_mm(x, w))
    xt = torch.randn(96, 20).bfloat16().t()
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="in place"):
        cpu_graph.capture(lambda: torch.ops.compilecore.packed_mm(xt, w), tmp_path)


def test_products_with_a_bias_are_recorded_into_cpu_graphs(kernel, tmp_path):
    """A bias (Qwen2's q/k/v) goes into the recorded call, oneDNN's included: on AMX CPUs
    a batched Qwen2 step ran piece by piece while the shim took no bias."""
    if kernel == "widened":
        pytest.skip("widened products are never recorded (the test above)")
    if kernel == "onednn" and onednn_shim.shim_call() is None:
        pytest.skip("this torch exports no AOTInductor shim for oneDNN's linear")
    w, bias = (torch.randn(40, 96) * 0.1).bfloat16(), torch.randn(40).bfloat16()
    x = torch.randn(3, 96).bfloat16()
    with torch.inference_mode():
        out, graph = cpu_graph.capture(lambda: torch.ops.compilecore.packed_mm(x, w, bias),
                                       tmp_path)  # fmt: skip
    assert torch.equal(out, torch.ops.compilecore.packed_mm(x, w, bias))
    x.copy_(torch.randn_like(x))
    bias.copy_(torch.randn_like(bias))
    assert torch.equal(graph.replay(), torch.ops.compilecore.packed_mm(x, w, bias))
    assert not torch.equal(graph.replay(), torch.ops.compilecore.packed_mm(x, w))


def test_a_failing_shim_call_fails_the_replay(tmp_path, monkeypatch):
    """A replay cannot raise from C: a failing shim call is counted, and the graph's check
    turns the count into an error after the replay (the next replay is clean)."""
    if not ONEDNN_BF16 or (call := onednn_shim.shim_call()) is None:
        pytest.skip("no bf16 oneDNN or no AOTInductor shim here")
    monkeypatch.setattr(packed_linear, "uses_own_kernel", lambda dtype: False)
    w, x = (torch.randn(40, 96) * 0.1).bfloat16(), torch.randn(12, 96).bfloat16()
    out, graph = cpu_graph.capture(lambda: torch.ops.compilecore.packed_mm(x, w), tmp_path)
    want = out.clone()
    fn, shim = call
    wrong_k = onednn_shim.Handle(torch.randn(40, 95).bfloat16())
    x_handle = onednn_shim.Handle(x)
    fn(shim.data_ptr(), x_handle.address, wrong_k.address, None, out.data_ptr(), out.nbytes)
    assert shim[3].item() == 1  # counted, not crashed
    with pytest.raises(RuntimeError, match="shim failed"):
        graph.replay()
    assert shim[3].item() == 0 and torch.equal(graph.replay(), want)


@pytest.mark.parametrize("dtype, matched", [(torch.bfloat16, 1), (torch.float32, 0)])
def test_pass_rewrites_16bit_gemms_only(dtype, matched):
    x, w = torch.randn(6, 32).to(dtype), (torch.randn(24, 32) * 0.2).to(dtype)
    backend = testing.check_pass(PackedLinearPass(), linear_relu, x, w)
    assert backend.matches("packed_linear") == matched
    assert testing.count_ops(backend.graph_after, aten.mm) == 1 - matched
    assert backend.ops_after().get("compilecore.packed_mm", 0) == matched


@pytest.mark.slow
def test_compiled_bf16_model_with_the_pass_matches_eager():
    from runtime.testing import compiled_eager_pair
    from tests.helpers import llama_config

    config = llama_config(num_hidden_layers=2)
    compiled, eager = compiled_eager_pair(config, dtype=torch.bfloat16)
    for n in (3, 17, 2):  # the symbolic-size code, where the pass applies
        ids = torch.randint(0, config.vocab_size, (n,))
        testing.assert_compiled_matches_eager(compiled, eager, ids, torch.arange(n), rtol=3e-2)


def test_packed_copies_come_from_huge_page_chunks():
    """Buffers are 64-byte aligned, never overlap, and a copy larger than a chunk gets a
    chunk of its own, 2 MiB aligned (where Linux backs it with huge pages)."""
    from passes.huge_pages import HUGE_PAGE

    arena = packed_linear._HugePageArena()
    small = [arena.alloc(n) for n in (100, 64, 4096, 1)]
    big = arena.alloc(arena.CHUNK + 1)
    after = arena.alloc(10)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in [*small, big, after])
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert all(b.data_ptr() % 64 == 0 for b in [*small, big, after])
    assert big.data_ptr() % HUGE_PAGE == 0 and big.numel() == arena.CHUNK + 1
    assert [b.numel() for b in small] == [100, 64, 4096, 1]
