"""`compilecore.gemv_logits`: the LM head's batch-1 product in our C loop (`gemv.cpp`,
AVX512-BF16). The oracle is the fp32 product of the same bf16 values: every pair product
is exact in fp32, so only the summation order differs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilecore import cpu_graph, testing
from passes import native, prefetch
from passes.ops import derived, gemv

pytestmark = pytest.mark.skipif(
    not gemv.own_kernel_available(torch.bfloat16), reason="no AVX512-BF16 here"
)


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


@testing.settings(max_examples=40)
@given(
    m=st.integers(1, 3), n=st.integers(1, 130),
    k=st.sampled_from([1, 31, 32, 33, 127, 128, 160, 300, 576, 1536]),
    pad=st.sampled_from([0, 5]),
)  # fmt: skip
def test_op_equals_the_exact_product(m, n, k, pad):
    """Tails of 1-31 values past each 128 and 32, one to three rows, and rows of x and w
    with a stride (views of wider rows); rows of 300, 576 and 1536 run the unrolled copy
    (300: a masked tail past the last 32)."""
    x = torch.randn(m, k + pad).bfloat16()[:, :k]
    w = (torch.randn(n, k + pad) * 0.1).bfloat16()[:, :k]
    got = torch.ops.compilecore.gemv_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want = _exact(x, w)
    # fp32 sums of k exact products: each addition rounds by at most 2^-24 of the sum
    bound = k * 2**-23 * (x.double().abs() @ w.double().abs().t())
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


def test_other_dtypes_are_refused_with_the_alternative():
    x, w = torch.randn(1, 32), torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="gemv_logits_reduction"):
        torch.ops.compilecore.gemv_logits(x, w)


def test_the_call_is_recorded_into_cpu_graphs(tmp_path):
    """Inside a capture the op records its C call: a replay on new input values equals the
    op called again. An input with strided columns is refused, not copied behind the
    capture's back."""
    w = (torch.randn(300, 576) * 0.1).bfloat16()
    x = torch.randn(1, 576).bfloat16()
    with torch.inference_mode():  # the output is an inference tensor, as in the engine
        out, graph = cpu_graph.capture(lambda: torch.ops.compilecore.gemv_logits(x, w), tmp_path)
    assert graph.num_calls == 1
    torch.testing.assert_close(out.double(), _exact(x, w), rtol=1e-5, atol=1e-5)
    x.copy_(torch.randn_like(x))
    assert torch.equal(graph.replay(), torch.ops.compilecore.gemv_logits(x, w))
    xt = torch.randn(1, 2 * 576).bfloat16()[:, ::2]
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="strided columns"):
        cpu_graph.capture(lambda: torch.ops.compilecore.gemv_logits(xt, w), tmp_path)


def test_compiled_bf16_engine_uses_it_at_batch_1():
    """The runtime gives a compiled bf16 CPU engine's LM head the op for one row (and the
    compiled reduction for fp32, or with `native_kernels=False`)."""
    from compilecore.compiled_function import StaticShapeFunction
    from compilecore.config import CompilationConfig, EngineConfig
    from runtime.lm_head import small_batch_lm_head
    from tests.helpers import llama_config

    def head(dtype: torch.dtype, native_kernels: bool = True):
        cc = CompilationConfig(cache_dir="/dev/null", native_kernels=native_kernels)
        config = EngineConfig.for_hf_config(llama_config(), dtype=dtype, compilation_config=cc)
        return small_batch_lm_head(config)

    bf16, fp32 = head(torch.bfloat16), head(torch.float32)
    assert bf16 is torch.ops.compilecore.gemv_logits
    assert isinstance(fp32, StaticShapeFunction)
    assert isinstance(head(torch.bfloat16, native_kernels=False), StaticShapeFunction)


def test_long_rows_get_an_unrolled_build_of_their_own():
    """The op's library for rows of 576 unrolls exactly that length; the generic build and
    short rows (test models) loop."""
    assert gemv._kernel(native.unrolled_sizes(576)).gemv_unrolled(576) == 1
    assert gemv._kernel(native.unrolled_sizes(576)).gemv_unrolled(577) == 0
    assert gemv._kernel().gemv_unrolled(576) == 0
    assert native.unrolled_sizes(64, 576, 1536, 576, 10**6) == (576, 1536)


def _screened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.compilecore.gemv_logits(x, w, torch.ones(1, dtype=torch.int64))


needs_screen = pytest.mark.skipif(not gemv.screen_available(), reason="no AVX512-VNNI here")


@needs_screen
@testing.settings(max_examples=40)
@given(
    n=st.integers(1, 3000), k=st.sampled_from([1, 33, 64, 200, 576]),
    spread=st.sampled_from([0.02, 1.0]), ties=st.integers(0, 3), seed=st.integers(0, 2**16),
    outlier=st.sampled_from([1.0, 30.0]),
)  # fmt: skip
def test_screened_head_keeps_the_full_products_argmax(n, k, spread, ties, seed, outlier):
    """With argmax_only set, rows that cannot win are -inf and the rest are the full
    product's values bit for bit, so the argmax (ties: the first index) is the same.
    Near-ties are forced by copying the best row below it (`ties` times, a few rows
    apart) and by rows that differ from it in one weight; `outlier` puts one large value
    in x, which coarsens the screen's int8 x."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * spread).bfloat16()
    x = torch.randn(1, k, generator=gen)
    x[0, seed % k] *= outlier
    x = x.bfloat16()
    full = torch.ops.compilecore.gemv_logits(x, w)
    best = int(full.argmax())
    for i in range(ties):  # exact copies of the winning row, before and after it
        w[(best + 7 * (i + 1) * (-1) ** i) % n] = w[best]
    if n > 2:
        w[(best + 1) % n] = w[best]
        w[(best + 1) % n, 0] = w[best, 0] + torch.tensor(0.001).bfloat16()
    full = torch.ops.compilecore.gemv_logits(x, w)
    screened = _screened(x, w)
    kept = screened > -torch.inf
    assert int(screened.argmax()) == int(full.argmax())
    assert torch.equal(screened[kept], full[kept])
    assert kept.sum() >= 1


@needs_screen
def test_screened_head_follows_the_flag_and_computes_few_rows(tmp_path):
    """Without argmax_only, or with more than one row, the head is the full product; a
    CPU graph recorded with the flag off follows it at replay. With a clear winner (a
    576-wide head of 4096 rows) few rows are computed exactly."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 576, generator=gen) * 0.05).bfloat16()
    x = (torch.randn(1, 576, generator=gen) * 2).bfloat16()
    full = torch.ops.compilecore.gemv_logits(x, w)
    flag, set_flag = gemv.argmax_only_flag()
    assert torch.equal(torch.ops.compilecore.gemv_logits(x, w, flag), full)  # off: all rows
    two = torch.cat([x, x])
    set_flag[0] = 1
    assert torch.equal(torch.ops.compilecore.gemv_logits(two, w, flag)[0], full[0])
    screened = torch.ops.compilecore.gemv_logits(x, w, flag)
    assert int(screened.argmax()) == int(full.argmax())
    assert (screened > -torch.inf).sum() < 4096 // 4
    set_flag[0] = 0
    with torch.inference_mode():
        op = torch.ops.compilecore.gemv_logits
        _, graph = cpu_graph.capture(lambda: op(x, w, flag), tmp_path)
    set_flag[0] = 1
    assert torch.equal(graph.replay(), screened)
    set_flag[0] = 0
    assert torch.equal(graph.replay(), full)


@needs_screen
def test_a_new_head_at_a_freed_heads_address_gets_its_own_screen():
    """Screens are found by address; a head of the same shape written where another was
    (a model made after one freed) is not screened with the old copy."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(512, 64, generator=gen) * 0.1).bfloat16()
    x = torch.randn(1, 64, generator=gen).bfloat16()
    first = _screened(x, w)
    w.copy_((torch.randn(512, 64, generator=gen) * 0.1).bfloat16())  # same address, new head
    full = torch.ops.compilecore.gemv_logits(x, w)
    again = _screened(x, w)
    assert int(again.argmax()) == int(full.argmax()) != int(first.argmax())


@needs_screen
def test_screen_bytes_are_the_int8_copy_and_its_row_data():
    """What a screened call reads in place of the head (benchmarks count it): N x Kp int8
    and four floats a row; nothing before the first screened call or after a reload."""
    w = (torch.randn(300, 100) * 0.1).bfloat16()
    assert gemv.screen_bytes(w) is None
    _screened(torch.randn(1, 100).bfloat16(), w)
    assert gemv.screen_bytes(w) == 300 * 128 + 300 * 4 * 4
    derived.weights_written()  # as after a write through .data: made again at next use
    assert gemv.screen_bytes(w) is None
    _screened(torch.randn(1, 100).bfloat16(), w)
    assert gemv.screen_bytes(w) is not None
    w.mul_(2)  # a write through torch moves the version counter
    assert gemv.screen_bytes(w) is None


@pytest.mark.parametrize("screened", [False, True])
def test_prefetching_builds_compute_the_same_bits(monkeypatch, screened):
    """The weight prefetch (`prefetch.weight_prefetch_bytes`: 4 KB on Intel CPUs, none
    elsewhere) moves no arithmetic: builds with and without it give the same logits, on
    a head long enough that each thread prefetches ahead of most rows (576-wide, unrolled),
    whole and screened. Both builds are made on any CPU, so each path is tested here."""
    if screened and not gemv.screen_available():
        pytest.skip("no AVX512-VNNI here")
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(700, 576, generator=gen) * 0.05).bfloat16()
    x = (torch.randn(1, 576, generator=gen) * 2).bfloat16()
    logits = []
    try:
        for ahead in (0, 4096):
            monkeypatch.setattr(prefetch, "weight_prefetch_bytes", lambda ahead=ahead: ahead)
            gemv._kernel.cache_clear()
            derived.forget("head_screen")
            logits.append(_screened(x, w) if screened else torch.ops.compilecore.gemv_logits(x, w))
    finally:
        monkeypatch.undo()
        gemv._kernel.cache_clear()
        derived.forget("head_screen")
    assert torch.equal(logits[0], logits[1])
    assert int(logits[1].argmax()) == int(_exact(x, w).argmax())
