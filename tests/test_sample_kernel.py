"""The step's tokens on the device (runtime/sample_kernel.py), in the Triton interpreter
here (TRITON_INTERPRET=1, tests/conftest.py) and natively on a GPU; and the same kernel
compiled for Hopper by Triton's own compiler, which needs no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import SamplingParams
from runtime.request import Request
from runtime.sampler import SAMPLE_GREEDY, SAMPLE_OFF, SAMPLE_PARAMS, Sampler, filter_logits

_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not _TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _draw(logits: torch.Tensor, requests: list[Request], mode: int = SAMPLE_PARAMS, out=None):
    """The kernel's tokens for these rows, each drawn as its request's next token."""
    from runtime.sample_kernel import sample_tokens

    floats, ints = zip(*(r.sample_row() for r in requests))
    flag = torch.tensor([mode], dtype=torch.int32, device=DEVICE)
    return sample_tokens(logits.to(DEVICE), flag, torch.tensor(floats, device=DEVICE),
                         torch.tensor(ints, device=DEVICE), out=out)  # fmt: skip


def _request(params: SamplingParams, position: int = 0, seed: int = 7) -> Request:
    """A request whose next token is its `position`-th output, drawn with key `seed`."""
    req = Request("r", [1], params)
    req.draw_seed = seed
    req.output_token_ids = [0] * position
    return req


@st.composite
def greedy_batches(draw):
    """Rows of one vocabulary, each finite (small integers: ties), masked in part or
    whole, or with a nan or a +inf; fp32 or bf16; a vocabulary across the kernel's trips."""
    vocab = draw(st.integers(1, 40) | st.integers(2040, 4200))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    rows = []
    kinds = ["ties", "masked", "all -inf", "nan", "+inf", "+inf and nan"]
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=5)):
        row = torch.randint(-3 if kind != "ties" else -1, 1, (vocab,), generator=gen).float()
        if kind != "ties":
            row[torch.rand(vocab, generator=gen) < 0.7] = -torch.inf
        if kind == "all -inf":
            row[:] = -torch.inf
        for special in ("+inf", "nan"):
            if special in kind:
                row[torch.randint(vocab, (2,), generator=gen)] = float(special)
        rows.append(row)
    return torch.stack(rows).to(draw(st.sampled_from([torch.float32, torch.bfloat16])))


@settings(max_examples=40, deadline=None)
@given(logits=greedy_batches(), sampled=st.booleans())
def test_greedy_rows_and_rows_without_a_distribution_get_the_samplers_tokens(logits, sampled):
    """Every greedy row gets the sampler's token (`Sampler._draw` in torch: the first
    argmax, the first +inf, NO_TOKEN for a nan or nothing above -inf), under the all-greedy
    flag and by its parameters; a sampled row with no distribution the same token; and
    nothing is written while the flag is off."""
    greedy = [_request(SamplingParams(temperature=0)) for _ in range(len(logits))]
    want = Sampler()._draw(logits.float(), greedy)
    assert _draw(logits, greedy, SAMPLE_GREEDY).tolist() == want.tolist()
    hot = _request(SamplingParams(temperature=1.0, top_k=3, top_p=0.9))
    mixed = [hot if sampled and i % 2 else r for i, r in enumerate(greedy)]
    got = _draw(logits, mixed).tolist()
    for i, row in enumerate(logits.float()):
        finite = bool(torch.isfinite(row.max())) and not bool(row.isnan().any())
        if mixed[i] is hot and finite:  # a draw: as likely as some token the filters keep
            kept = filter_logits(row[None], [hot.sampling_params])[0] > -torch.inf
            assert row[got[i]] >= row[kept].min()
        else:
            assert got[i] == want[i]
    wider = torch.full((len(logits), logits.shape[1] + 3), torch.inf, dtype=logits.dtype)
    wider[:, : logits.shape[1]] = logits  # rows apart by a stride past the vocabulary
    assert _draw(wider[:, : logits.shape[1]], greedy).tolist() == want.tolist()
    untouched = torch.full_like(want, 7, device=DEVICE)
    _draw(logits, greedy, SAMPLE_OFF, out=untouched)
    assert untouched.tolist() == [7] * len(want)


@st.composite
def filtered_rows(draw):
    """A row (vocabularies within one trip of the kernel and across two), params with
    each filter on about half the time, and a seed."""
    seed = draw(st.integers(0, 2**31))
    vocab = draw(st.integers(2, 40) | st.integers(1025, 1500))
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    if draw(st.booleans()):  # ties at the top: top-k keeps every token equal to the k-th
        logits = logits.round()
    params = SamplingParams(
        temperature=draw(st.floats(0.2, 2.0)),
        top_k=draw(st.just(0) | st.integers(1, 12)),
        top_p=draw(st.just(1.0) | st.floats(0.05, 0.95)),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
    )
    return logits * draw(st.floats(0.5, 4.0)), params, seed


@settings(max_examples=25, deadline=None)
@given(row=filtered_rows())
def test_draws_keep_to_what_filter_logits_keeps(row):
    """Twelve draws of one row: each a token at least as likely as the least likely one
    the sort-based `filter_logits` keeps (top-k's radix select and top-p's rejection find
    the same set, but for ties at top-p's edge: the sort keeps an arbitrary part of them,
    the kernel all); where it keeps one token with no equal, that one every time."""
    logits, params, seed = row
    kept = filter_logits(logits[None], [params])[0] > -torch.inf
    tokens = _draw(logits.repeat(12, 1), [_request(params, i, seed) for i in range(12)]).cpu()
    least = logits[kept].min()
    assert (logits[tokens] >= least).all(), (tokens.tolist(), kept.nonzero().flatten().tolist())
    if int((logits >= least).sum()) == 1:
        assert set(tokens.tolist()) == set(kept.nonzero().flatten().tolist())


@pytest.mark.parametrize("signed_zeros", [False, True])
def test_top_k_keeps_every_token_tied_with_the_kth(signed_zeros):
    """Top-3 of a row whose three best are tied with two more: all five are drawn, none
    other (vLLM keeps ties); and top-1 where the best are 0.0 and -0.0 (equal values)."""
    logits = torch.full((300,), -4.0)
    tied = [3, 40, 41, 200, 299]
    logits[tied] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0]) if signed_zeros else 1.0
    params = SamplingParams(temperature=1.0, top_k=1 if signed_zeros else 3)
    tokens = _draw(logits.repeat(40, 1), [_request(params, i) for i in range(40)])
    assert set(tokens.tolist()) == set(tied)


@pytest.mark.parametrize("vocab, k", [(50, 1), (300, 5), (1500, 8)])
def test_top_k_draws_the_k_largest_and_no_other(vocab, k):
    """A nearly flat row of distinct values: 60 draws under top-k land on exactly the k
    largest (the radix select's threshold is the k-th value, not a key beside it)."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 0.05
    params = SamplingParams(temperature=1.0, top_k=k)
    tokens = _draw(logits.repeat(60, 1), [_request(params, i) for i in range(60)])
    assert set(tokens.tolist()) == set(logits.topk(k).indices.tolist())


PEAKED = [0.05, 0.4, 0.02, 0.15, 0.25, 0.1, 0.03]  # not in index order
# Two likely tokens in a long tied tail: top-p = 0.3 keeps the two, and 60% of first
# draws land in the tail and are rejected, so most tokens come from a second draw.
TAILED = [0.2 if i in (5, 20) else 0.6 / 30 for i in range(32)]


@pytest.mark.parametrize(
    "probs, params",
    [
        (PEAKED, SamplingParams(temperature=0.7, top_p=0.8)),
        (TAILED, SamplingParams(temperature=1.0, top_p=0.3)),
        (PEAKED, SamplingParams(temperature=1.0, top_k=4, top_p=0.6, min_p=0.1)),
    ],
    ids=["top_p", "top_p_redrawn", "all_filters"],
)
def test_draws_follow_filter_logits(probs, params):
    """250 draws of a row: each kept token's count within a chi-square test of its
    probability after the filters (renormalized after top-k, as vLLM), also where top-p
    rejects most first candidates; the draws are fixed by their seed, so this passes or
    fails the same every run."""
    logits = torch.tensor(probs).log()
    n = 250
    tokens = _draw(logits.repeat(n, 1), [_request(params, i, seed=11) for i in range(n)])
    want = filter_logits(logits[None], [params])[0].softmax(-1).double().numpy()
    counts = np.bincount(tokens.cpu().numpy(), minlength=len(probs))
    assert counts[want == 0].sum() == 0
    expected = n * want[want > 0]
    chi2 = ((counts[want > 0] - expected) ** 2 / expected).sum()
    assert chi2 < 16.3, (counts, expected)  # df <= 3: p = 0.001


def test_a_seeded_token_depends_on_its_seed_and_index_only():
    """A row drawn beside other rows, at another row index, or alone gives the same
    token for the same seed and output index; other indices and seeds draw others."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.2  # flat
    params = SamplingParams(temperature=1.0, top_p=0.9)
    mine = _request(params, position=5, seed=123)
    others = [_request(params, i, seed=9) for i in range(3)]
    alone = _draw(logits[None], [mine]).item()
    batch = _draw(logits.repeat(4, 1), [*others[:2], mine, others[2]]).tolist()
    assert batch[2] == alone
    later = [_draw(logits[None], [_request(params, p, seed=123)]).item() for p in range(6, 12)]
    seeds = [_draw(logits[None], [_request(params, 5, seed=s)]).item() for s in range(6)]
    assert len(set(later)) > 2 and len(set(seeds)) > 2


def test_the_engine_keys_unseeded_requests_by_its_own_seed():
    """A request without a seed gets its draw key from the sampler's seed when it
    arrives: the same for the same seed and arrival order, another for another seed; a
    seed the request names is its key (as an int64)."""
    keys = []
    for seed in (0, 0, 1):
        sampler = Sampler(seed)
        reqs = [Request(str(i), [1], SamplingParams(temperature=1.0)) for i in range(2)]
        for req in reqs:
            sampler.seed_request(req)
        keys.append([r.draw_seed for r in reqs])
    assert keys[0] == keys[1] and keys[0] != keys[2] and keys[0][0] != keys[0][1]
    named = Request("n", [1], SamplingParams(temperature=1.0, seed=2**64 - 1))
    Sampler().seed_request(named)
    assert named.draw_seed == -1


def test_the_samplers_cuda_path_draws_each_requests_next_token():
    """`Sampler._draw`'s CUDA path, on CPU tensors here: a request without a seed gets
    its key from the sampler's seed, each row is drawn by its request's parameters and
    token index (the kernel's tokens for the same rows), a row view with a stride is
    read as it is."""
    params = [SamplingParams(temperature=0.9, top_k=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_p=0.7, seed=5)]  # fmt: skip
    requests = [Request(str(i), [1], p) for i, p in enumerate(params)]
    requests[2].output_token_ids = [4, 4]
    wide = torch.randn(3, 70, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(3)
    got = sampler._draw_kernel(wide[:, :64], requests)
    assert requests[0].draw_seed is not None and requests[2].draw_seed == 5
    assert got.tolist() == _draw(wide[:, :64].contiguous(), requests).tolist()
    assert got[1] == wide[1, :64].argmax()


def test_the_kernel_compiles_for_hopper():
    """Triton's compiler (not the interpreter the other tests run) takes the kernel to a
    cubin for sm_90 with fp32 and bf16 logits: what a GPU machine does at its first
    sampled step. Skipped where Triton has no NVIDIA backend."""
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from runtime.sample_kernel import _sample_kernel
        sig = {"logits_ptr": "*fp32", "stride": "i32", "vocab": "i32", "flag_ptr": "*i32",
               "float_ptr": "*fp32", "int_ptr": "*i64", "out_ptr": "*i64",
               "NO_TOKEN_ID": "constexpr", "BLOCK": "constexpr"}
        for logits in ("*fp32", "*bf16"):
            source = ASTSource(_sample_kernel, {**sig, "logits_ptr": logits},
                               constexprs={"NO_TOKEN_ID": -1, "BLOCK": 1024})
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 8})
            assert kernel.asm["cubin"], logits
        """
    )
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("Triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_step_draws_in_its_graph_where_every_request_samples_plainly():
    """`plan_step` hands the graph each row's parameters where a device draws them and
    every request samples plainly and some not greedily; all greedy is the argmax flag;
    any request with logprobs, logits processing or min_tokens sends the step to the
    host sampler. A row's token index counts the tokens still on the device (async
    scheduling)."""
    from compilecore.config import CacheConfig, SchedulerConfig
    from runtime.model_runner import plan_step
    from runtime.scheduler import Scheduler

    def planned(*params: SamplingParams, device_draws: bool = True):
        scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=64)
        requests = [Request(str(i), [1, 2, 3], p) for i, p in enumerate(params)]
        for req in requests:
            Sampler(5).seed_request(req)
            scheduler.add_request(req)
        out = scheduler.schedule()
        return plan_step(out, scheduler.block_manager, device_draws)[0], requests

    hot = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, seed=3)
    plan, requests = planned(hot, SamplingParams(temperature=0))
    assert not plan.argmax_only
    greedy_row = ((0.0, 1.0, 0.0), (0, requests[1].draw_seed, 0))
    assert plan.sample_rows == [((0.8, 0.9, 0.1), (5, 3, 0)), greedy_row]
    plan, _ = planned(SamplingParams(temperature=0), SamplingParams(temperature=0))
    assert plan.argmax_only and plan.sample_rows == []
    plan, _ = planned(hot, SamplingParams(temperature=0), device_draws=False)  # CPU: no graph
    assert plan.sample_rows == [] and not plan.argmax_only
    for other in (
        SamplingParams(temperature=0.8, logprobs=1),
        SamplingParams(temperature=0.8, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, min_tokens=2),
    ):
        plan, _ = planned(hot, other)
        assert plan.sample_rows == [] and not plan.argmax_only
    req = _request(hot, position=2)
    req.num_pending = 1
    assert req.sample_row()[1][2] == 3


@pytest.mark.gpu
def test_the_kernel_checks_above_hold_compiled_on_cuda():
    """Here the checks above run in the interpreter; on a device (benchmarks/gpu_check.py
    runs the GPU-marked tests) they run again on the kernel as Triton compiles it."""
    assert DEVICE == "cuda"
    for probs, params in [(PEAKED, SamplingParams(temperature=0.7, top_p=0.8)),
                          (TAILED, SamplingParams(temperature=1.0, top_p=0.3))]:  # fmt: skip
        test_draws_follow_filter_logits(probs, params)
    for signed_zeros in (False, True):
        test_top_k_keeps_every_token_tied_with_the_kth(signed_zeros)
    test_top_k_draws_the_k_largest_and_no_other(1500, 8)
    test_a_seeded_token_depends_on_its_seed_and_index_only()
    test_draws_keep_to_what_filter_logits_keeps()
    test_greedy_rows_and_rows_without_a_distribution_get_the_samplers_tokens()
