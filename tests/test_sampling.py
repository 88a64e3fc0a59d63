"""Sampling: parameter validation, the sampler's distributions and filters, and the
engine's seeded, stop-string, stop-token and logprob behaviour."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import LLM, SamplingParams
from runtime.cpu_sampling import (
    NO_TOKEN,
    _kernel,
    _search,
    degenerate_row_token,
    kept_weights,
    row_logprobs,
    sample_rows,
)
from runtime.request import Request
from runtime.sampler import Sampler, filter_logits


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": -2}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"detokenize": "no"}, "detokenize"),
        ({"detokenize": False, "stop": "."}, "stop"),
        ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens"),
        ({"extra_args": [1]}, "extra_args"),
    ],
)
def test_bad_sampling_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**kwargs)


def _rows(params: SamplingParams, n: int) -> list[Request]:
    """n requests with these params, request i seeded with i."""
    seeded = SamplingParams(**{**_fields(params), "seed": 0})
    return [Request(str(i), [1], seeded.for_sample(i)) for i in range(n)]


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__ if not k.startswith("_")}


# The two ways a row is drawn: on CPU in numpy by the inverse CDF (`sample_row`), on other
# devices by the exponential race (`Sampler._sample`, run here on CPU tensors).
PATHS = ["cpu_rows", "race"]


def _draw(params: SamplingParams, probs: list[float], n: int = 3000, path: str = "cpu_rows"):
    logits = torch.tensor(probs).log().repeat(n, 1)
    rows = _rows(params, n)
    if path == "race":
        return Sampler()._sample(logits, rows)
    return torch.tensor(Sampler()(logits, rows).token_ids)


@pytest.mark.parametrize("path", PATHS)
def test_sampling_follows_the_distribution(path):
    probs = [0.5, 0.3, 0.15, 0.05]
    draws = _draw(SamplingParams(temperature=1.0), probs, path=path)
    assert torch.allclose(torch.bincount(draws, minlength=4) / 3000, torch.tensor(probs), atol=0.03)


@pytest.mark.parametrize("path", PATHS)
def test_temperature_sharpens(path):
    probs = [0.5, 0.3, 0.15, 0.05]
    cold = torch.bincount(_draw(SamplingParams(temperature=0.5), probs, path=path), minlength=4)
    expect = torch.tensor(probs) ** 2
    assert torch.allclose(cold / 3000, expect / expect.sum(), atol=0.03)


@st.composite
def filtered_rows(draw) -> tuple[torch.Tensor, SamplingParams]:
    """A row of logits (small vocabularies, and ones past the draw's 4096-token blocks)
    and params with each filter on about half the time."""
    seed = draw(st.integers(0, 10**6))
    vocab = draw(st.integers(4, 40) | st.integers(4097, 12000))
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(
        temperature=draw(st.floats(0.2, 2.0)),
        top_k=draw(st.just(0) | st.integers(1, 60)),
        top_p=draw(st.just(1.0) | st.floats(0.05, 0.999)),
        min_p=draw(st.sampled_from([0.0, 0.01, 0.2])),
    )
    return logits * draw(st.floats(0.5, 8.0)), params


@settings(max_examples=80, deadline=None)
@given(row=filtered_rows())
def test_cpu_rows_keep_what_filter_logits_keeps(row):
    """The numpy path finds the kept tokens without sorting the row (thresholds, then
    only the candidates sorted): its renormalized probabilities equal those of
    `filter_logits` (sort-based, vLLM's order) followed by a softmax."""
    logits, params = row
    vocab = logits.shape[0]
    ids, weights = kept_weights(logits.numpy(), params)
    got = np.zeros(vocab)
    got[slice(None) if ids is None else ids] = weights
    expect = filter_logits(logits[None], [params])[0].softmax(-1).double().numpy()
    np.testing.assert_allclose(got / got.sum(), expect, rtol=1e-4, atol=1e-7)


# Both ways `sample_rows` draws on CPU: the C kernel and numpy a row at a time.
KERNELS = [pytest.param(True, id="c"), pytest.param(False, id="numpy")]


def _grid_shares(logits: np.ndarray, params: SamplingParams, n: int, kernel: bool) -> np.ndarray:
    """Each token's share of draws at n uniforms evenly spaced over [0, 1)."""
    assert _kernel() is not None or not kernel  # built here: the C case is not numpy again
    rows = [(0, params, (j + 0.5) / n) for j in range(n)]
    tokens = sample_rows(logits[None], rows, kernel=kernel)
    return np.bincount(tokens, minlength=logits.shape[0]) / n


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(1, 40) | st.integers(4097, 9000),
    zeros=st.floats(0.0, 0.95),
)
def test_inverse_cdf_gives_each_token_its_share(kernel, seed, vocab, zeros):
    """Uniform draws on a grid: each token is drawn for a share of the grid within one
    step of its probability, a zero-probability token never, and the largest draw below
    1 still lands on a token that may be drawn (rounding at the very end of the range)."""
    gen = np.random.default_rng(seed)
    weights = gen.exponential(size=vocab) * (gen.random(vocab) >= zeros)
    weights[gen.integers(vocab)] = 1.0
    with np.errstate(divide="ignore"):
        logits = np.log(weights / weights.max()).astype(np.float32)  # -inf for the zeros
    probs = np.exp(logits.astype(np.float64))
    probs /= probs.sum()
    params = SamplingParams(temperature=1.0)
    n = 2000
    assert np.all(np.abs(_grid_shares(logits, params, n, kernel) - probs) <= 1 / n + 1e-6)
    last = sample_rows(logits[None], [(0, params, np.nextafter(1.0, 0.0))], kernel=kernel)
    assert probs[last[0]] > 0


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=40, deadline=None)
@given(row=filtered_rows())
def test_draws_follow_filter_logits(kernel, row):
    """Draws on a grid land on each token as often as the sort-based `filter_logits` and a
    softmax say (within a grid step), and never on a token it drops."""
    logits, params = row
    probs = filter_logits(logits[None], [params])[0].softmax(-1).double().numpy()
    n = 1000
    share = _grid_shares(logits.numpy(), params, n, kernel)
    assert np.all(np.abs(share - probs) <= 1 / n + 1e-5)
    assert np.all(probs[share > 0] > 0)


ADVERSARIAL_PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.5, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.3),
]


@st.composite
def adversarial_rows(draw):
    """A row of fp32 logits with -inf (masked) tokens, and sometimes every token -inf, a
    nan or a +inf; the params that sample it and a uniform draw."""
    inf = np.float32(np.inf)
    vocab = draw(st.integers(1, 40) | st.integers(1025, 2100))
    gen = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row = (gen.normal(size=vocab) * 4).astype(np.float32)
    row[gen.random(vocab) < draw(st.sampled_from([0.0, 0.5, 0.99]))] = -inf
    kind = draw(st.sampled_from(["finite", "masked", "nan", "+inf", "+inf and nan"]))
    if kind == "masked":
        row[:] = -inf
    for special, name in ((inf, "+inf"), (np.nan, "nan")):
        if name in kind:
            row[gen.integers(vocab, size=draw(st.integers(1, 3)))] = special
    return row, draw(st.sampled_from(ADVERSARIAL_PARAMS)), draw(st.floats(0.0, 0.999999))


@settings(max_examples=150, deadline=None)
@given(case=adversarial_rows())
def test_every_sampler_path_gives_a_degenerate_row_the_same_token(case):
    """C, numpy, the CPU sampler (plain and with logits processing) and the torch path
    (CUDA's) on the same adversarial row: a row with no distribution gets the one
    documented token on every path (the first +inf, else NO_TOKEN for a nan or all -inf);
    a row with one gets, on every path, a token whose logit is finite; greedy rows the
    same first argmax. Before, C crashed on an all -inf row under top-p or top-k."""
    row, params, u = case
    expected = degenerate_row_token(row) if not np.isfinite(row.max()) else None
    logits = row[None]
    processed = SamplingParams(**{**_fields(params), "logit_bias": {0: 0.0}})

    def sampler(path: str, p: SamplingParams) -> int:
        rows = torch.from_numpy(row.copy())[None]
        if path == "torch":
            return Sampler()._sample_torch(rows, _rows(p, 1), frozenset()).token_ids[0]
        return Sampler()(rows, _rows(p, 1)).token_ids[0]

    tokens = {
        "cpu plain": sampler("cpu", params),
        "cpu processed": sampler("cpu", processed),
        "torch": sampler("torch", params),
    }
    if not params.greedy:  # greedy rows take the argmax, not a draw
        tokens["c"] = sample_rows(logits, [(0, params, u)], kernel=True)[0]
        tokens["numpy"] = sample_rows(logits, [(0, params, u)], kernel=False)[0]
    if expected is not None:
        assert set(tokens.values()) == {expected}, tokens
    elif params.greedy:
        assert set(tokens.values()) == {int(row.argmax())}, tokens
    else:
        assert all(t != NO_TOKEN and np.isfinite(row[t]) for t in tokens.values()), tokens


def test_degenerate_row_token_is_documented():
    inf, nan = float("inf"), float("nan")
    rows = np.array([[0, nan, 1, inf], [0, inf, 1, inf], [-inf] * 4], np.float32)
    assert [degenerate_row_token(r) for r in rows] == [NO_TOKEN, 1, NO_TOKEN]


@pytest.mark.parametrize("kernel", KERNELS)
def test_top_p_after_top_k_is_renormalized(kernel):
    """Top-2 of [0.4, 0.3, 0.2, 0.1] renormalized is [4/7, 3/7]: top_p=0.5 keeps one token
    (against the unrenormalized 0.4 it would keep two)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    params = SamplingParams(top_k=2, top_p=0.5)
    assert torch.isfinite(filter_logits(logits[None], [params])[0]).tolist() == [1, 0, 0, 0]
    assert _grid_shares(logits.numpy(), params, 100, kernel).tolist() == [1, 0, 0, 0]


def test_two_threads_sampling_at_once_each_get_their_own_tokens():
    """The kernel's argument buffers are kept per thread (a call releases the GIL, and two
    engines may step on two threads): rows sampled on two threads at once, again and
    again, give the tokens each gives alone."""
    assert _kernel() is not None
    gen = np.random.default_rng(0)
    rows = {"a": gen.normal(0, 3, (2, 5000)), "b": gen.normal(0, 3, (2, 7000))}
    rows = {k: v.astype(np.float32) for k, v in rows.items()}
    params = SamplingParams(temperature=0.8, top_p=0.95)
    grid = np.linspace(0.01, 0.99, 40).tolist()

    def draws(name: str) -> list[list[int]]:
        x = rows[name]
        return [sample_rows(x, [(i, params, (u + i / 3) % 1) for i in range(len(x))]) for u in grid]

    alone = {name: draws(name) for name in rows}
    assert alone["a"] != alone["b"]  # same batch size: shared buffers would mix them
    start = threading.Barrier(2)
    together: dict[str, list] = {}

    def run(name: str) -> None:
        start.wait()
        together[name] = [draws(name) for _ in range(25)]

    threads = [threading.Thread(target=run, args=(name,)) for name in rows]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got == alone[name] for name in rows for got in together[name])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(2, 40) | st.integers(4097, 9000),
    scale=st.floats(0.5, 20.0),
    n=st.integers(0, 25),
)
def test_cpu_logprobs_equal_the_torch_path(seed, vocab, scale, n):
    """`row_logprobs` (numpy, thresholds then the candidates sorted) against
    `Sampler._logprobs` (torch's log_softmax and topk, the path on other devices)."""
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    token = seed % vocab
    got = row_logprobs(logits[0].numpy(), token, n)
    expect = Sampler._logprobs(logits, [SamplingParams(logprobs=n)], [token])[0]
    assert got.keys() == expect.keys()
    for t, (value, rank) in expect.items():
        assert got[t][1] == rank and got[t][0] == pytest.approx(value, abs=1e-5)


def test_top_p_counts_the_mass_below_the_candidates():
    """Two tokens above the first threshold hold 1.5 of 2.0: enough to be the candidates
    for top_p=0.55, but the nucleus is measured against all 2.0 (1.1), so both stay."""
    logits = torch.tensor([1.0, 0.5] + [1e-3] * 500).log()
    params = SamplingParams(top_p=0.55)
    ids, _ = kept_weights(logits.numpy(), params)
    assert sorted(ids.tolist()) == [0, 1]
    assert torch.isfinite(filter_logits(logits[None], [params])[0]).sum() == 2


def test_top_k_keeps_ties_with_the_kth_like_vllm():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0])
    params = SamplingParams(top_k=2)
    ids, _ = kept_weights(logits.numpy(), params)
    assert sorted(ids.tolist()) == [0, 1, 2, 4]
    kept = torch.isfinite(filter_logits(logits[None], [params])[0])
    assert kept.nonzero().flatten().tolist() == [0, 1, 2, 4]


def test_a_draw_rounded_past_the_end_takes_the_last_token_that_may_be_drawn():
    weights = np.array([0.0, 1.0, 2.0, 0.0, 0.0])
    assert _search(weights, 3.0) == (2, 2.0)
    assert _search(weights, 2.5)[0] == 2 and _search(weights, 0.0)[0] == 1


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(top_k=1), {0}),
    ],
)
def test_filters_keep_only_allowed_tokens(params, allowed):
    tokens = set(_draw(params, [0.5, 0.3, 0.15, 0.05], n=500).tolist())
    assert tokens == allowed


def test_greedy_rows_ignore_noise():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0]])
    rows = [Request(str(i), [1], SamplingParams(temperature=0)) for i in range(2)]
    out = Sampler()(logits, rows)
    assert out.token_ids == [1, 0]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 4), vocab=st.integers(2, 64))
def test_plain_greedy_path_equals_the_general_one(seed, rows, vocab):
    """Plain greedy rows take the argmax-only path: the tokens torch's argmax gives (ties:
    the first index; small integer logits make ties common). A row with a logit bias and
    logprobs leaves the path for the whole batch, and the others' tokens do not change."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows + 1, vocab), generator=gen).float()
    plain = [Request(str(i), [1], SamplingParams(temperature=0)) for i in range(rows)]
    assert all(r.plain_greedy for r in plain)
    out = Sampler()(logits[:rows], plain)
    assert out.token_ids == logits[:rows].argmax(dim=-1).tolist()
    assert out.logprobs == [None] * rows
    biased = Request("b", [1], SamplingParams(temperature=0, logit_bias={0: 100.0}, logprobs=1))
    assert not biased.plain_greedy
    mixed = Sampler()(logits, plain + [biased])
    assert mixed.token_ids == out.token_ids + [0]
    assert mixed.logprobs[-1] is not None and mixed.logprobs[0] is None


# -- through the engine ----------------------------------------------------------------
PROMPTS = ["The quick brown fox", "Paris is the capital", "héllo 🙂 wörld"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), enforce_eager=True)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seed_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm, PROMPTS[0], seeded)[0]
    others = [
        SamplingParams(temperature=0.8, max_tokens=5),
        SamplingParams(temperature=1.0, seed=7),
    ]
    mixed = _tokens(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others[0], seeded, others[1]])
    assert mixed[1] == alone
    greedy = _tokens(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert alone != greedy  # the seed really sampled


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = _tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    top_k = _tokens(llm, PROMPTS, SamplingParams(top_k=1, max_tokens=16, ignore_eos=True))
    top_p = _tokens(llm, PROMPTS, SamplingParams(top_p=1e-6, max_tokens=16, ignore_eos=True))
    assert top_k == greedy and top_p == greedy


def test_n_samples_differ_and_use_their_own_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1
    again = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples


def test_stop_string_is_trimmed(llm):
    base = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    full = llm.generate(PROMPTS[1], base, use_tqdm=False)[0].outputs[0]
    stop = full.text[10:13]
    assert stop and stop in full.text
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    params.include_stop_str_in_output = True
    kept = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    full = llm.generate(PROMPTS[0], base, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[3]
    first = full.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    late = SamplingParams(
        temperature=0,
        max_tokens=32,
        ignore_eos=True,
        stop_token_ids=[stop_id],
        min_tokens=first + 2,
    )
    out = llm.generate(PROMPTS[0], late, use_tqdm=False)[0].outputs[0]
    # vLLM masks stop tokens until min_tokens: never sampled early, then they stop it.
    assert len(out.token_ids) >= first + 2 and stop_id not in out.token_ids[: first + 2]
    assert out.token_ids[-1] == stop_id or len(out.token_ids) == 32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"allowed_token_ids": [2], "min_tokens": 1}, "min_tokens=1 forbids"),
        ({"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2}, "forbids"),
    ],
)
def test_constraints_that_leave_no_first_token_are_refused_before_queueing(llm, kwargs, message):
    """EOS (id 2 here) is the only allowed token, but min_tokens masks it: nothing could be
    generated, and the sampler would see a row of -inf. A ValueError (a 400 through the
    server) names why; the LLM keeps serving."""
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, top_p=0.9, **kwargs))
    assert not llm.llm_engine.has_unfinished_requests()
    ok = SamplingParams(allowed_token_ids=[2], min_tokens=1, ignore_eos=True, max_tokens=2)
    assert llm.generate(PROMPTS[0], ok, use_tqdm=False)[0].outputs[0].token_ids == [2, 2]


def test_bad_words_banning_every_allowed_token_are_refused(llm):
    word = "The"
    ids = llm.tokenizer.encode(word, add_special_tokens=False)
    assert len(ids) == 1
    with pytest.raises(ValueError, match="bad_words ban every token"):
        llm.generate(PROMPTS[0], SamplingParams(allowed_token_ids=ids, bad_words=[word]))


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_a_row_masked_mid_request_finishes_it_with_error_and_keeps_its_tokens(
    llm, temperature, top_p
):
    """Only token `a` is allowed, and the two-token bad word [a, a] bans it once the
    output ends in `a`: the second step has every token -inf, which no check before the
    request runs can see. The request finishes with finish_reason "error" after its one
    token (before, the C sampler dereferenced an empty vector under top-p); a request
    batched with it is untouched."""
    word = "ZZ"
    ids = llm.tokenizer.encode(word, add_special_tokens=False)
    assert len(ids) == 2 and ids[0] == ids[1]
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=1, max_tokens=8,
                            allowed_token_ids=ids[:1], bad_words=[word])  # fmt: skip
    other = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], other, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [params, other], use_tqdm=False)
    masked = outs[0].outputs[0]
    assert masked.token_ids == ids[:1] and masked.finish_reason == "error"
    assert outs[1].outputs[0].token_ids == alone
    assert not llm.llm_engine.has_unfinished_requests()
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_logprobs_match_hf_log_softmax(llm, tiny_llama):
    hf = tiny_llama[1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    res = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    out = res.outputs[0]
    ids = list(res.prompt_token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        top = ref.topk(3)
        assert len(entry) == 3 and token in entry
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
            assert entry[tid].rank == rank + 1
            assert entry[tid].decoded_token == llm.tokenizer.decode([tid])
        ids.append(token)
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids))
    )


def test_seeded_generator_follows_the_logits_device():
    """Per-request generators are made on the logits' device (a CPU generator cannot
    drive sampling on CUDA logits), seeded from the request, and reproduce its draws."""
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(1, 50)
    first = Request("a", [1], params)
    tokens = [Sampler()(logits, [first]).token_ids[0] for _ in range(3)]
    assert first.generator is not None and first.generator.device == logits.device
    again = Request("b", [1], params)
    assert [Sampler()(logits, [again]).token_ids[0] for _ in range(3)] == tokens
