"""Speculative decoding by n-gram lookup (runtime/spec_decode.py), verified through the
compiled steps. The oracle is the same model's engine without it (fp32, so a verification
row's logits pick the token a one-token step picks): every request's tokens, finish
reason and text are the same, and no KV block is left held."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilecore import testing
from compilecore.config import SpeculativeConfig
from runtime import LLM, SamplingParams
from runtime.request import Request
from runtime.spec_decode import (
    FIRST_PAUSE,
    DraftModelProposer,
    Proposer,
    accepted_length,
    ngram_proposal,
    sample_verified,
)
from tests.helpers import all_blocks_free, completions

ENGINE = {"dtype": "float32", "block_size": 4, "max_model_len": 96}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
# The engines' tests verify every lookup (floor 1: none watched) to test exactness often.
VERIFY_ALL = {**NGRAM, "min_tokens_per_verification": 1.0}


def _occurrences(tokens: list[int], n: int) -> list[int]:
    """End indices e < len - 1 where tokens[e-n+1 : e+1] equals the last n tokens."""
    last = len(tokens) - 1
    suffix = tokens[last - n + 1 :]
    return [e for e in range(n - 1, last) if tokens[e - n + 1 : e + 1] == suffix]


@testing.settings(max_examples=300)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    k=st.integers(1, 5),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_ngram_proposal_is_what_followed_the_longest_match(tokens, k, n_min, extra):
    n_max = n_min + extra
    got = ngram_proposal(tokens, k, n_min, n_max)
    lengths = [n for n in range(n_min, n_max + 1) if n < len(tokens) and _occurrences(tokens, n)]
    if not lengths:
        assert got == []
        return
    n = max(lengths)
    follows = [tokens[e + 1 : e + 1 + k] for e in _occurrences(tokens, n)]
    assert got in follows  # what followed an occurrence of the longest suffix
    assert len(got) == max(len(f) for f in follows)  # as many as any occurrence has


def _emit(req: Request, *tokens: int) -> None:
    for t in tokens:
        req.append_token(t)
    req.num_computed_tokens = req.num_tokens - 1


def test_accepted_length_and_watching_lookups():
    """A request watches its lookups while its score (tokens accepted per outcome, halved
    toward each new one) says a verification would not emit the floor's tokens, judging
    each watched lookup by the tokens the request goes on to emit; it sends drafts while
    the score pays, and a verification that fails sends it back to watching."""
    assert accepted_length([5, 6, 7, 8], [5, 6, 9]) == 2
    assert accepted_length([1, 2], [3]) == 0
    assert accepted_length([4, 4, 4, 4], [4, 4, 4]) == 3
    assert accepted_length([4], [4, 4, 4]) == 1  # a watched lookup, one token emitted after it
    req = Request("r", [1, 2, 1, 2, 1], SamplingParams(temperature=0, max_tokens=50))
    _emit(req)
    config = SpeculativeConfig(**NGRAM, min_tokens_per_verification=2.5)
    proposer = Proposer(config, max_model_len=96)
    assert proposer.propose(req) == []  # watched: the longest match (3 tokens) has [2, 1] after it
    assert req.spec.shadow == [2, 1]
    _emit(req, 2)
    assert proposer.propose(req) == [] and req.spec.shadow == [2, 1]  # right so far
    _emit(req, 1)  # came true whole: 2 accepted, score 1: 2 tokens a verification < 2.5
    assert proposer.propose(req) == [] and req.spec.shadow == [2, 1, 2]
    assert req.spec.score == 1.0
    _emit(req, 2, 1, 2)  # 3 accepted: score 2
    drafts = ngram_proposal(req.all_token_ids, 3, 1, 3)
    assert proposer.propose(req) == drafts != []  # drafts sent
    assert req.spec.score == 2.0 and req.spec.num_drafts == 0  # watched ones are not counted
    proposer.record(req, 3, 0)  # a verification that failed: score 1, watching again
    assert req.spec.num_drafts == 1 and req.spec.score == 1.0
    assert proposer.propose(req) == [] and req.spec.shadow
    _emit(req, 7)  # the watched lookup failed at once: judged (0 accepted)
    assert proposer.propose(req) == [] and req.spec.score == 0.5
    sampled = Request("s", [1, 2, 1, 2, 1], SamplingParams(temperature=1.0, seed=3))
    _emit(sampled)
    always = Proposer(SpeculativeConfig(**NGRAM, min_tokens_per_verification=1.0), 96)
    assert always.propose(sampled) == [2, 1]  # sampled ones too; floor 1: never watched
    logprobs = Request("l", [1, 2, 1, 2, 1], SamplingParams(temperature=0, logprobs=1))
    _emit(logprobs)
    assert always.propose(logprobs) == []  # not where a row's logprobs are asked for
    near_end = Request("e", [1, 2, 1, 2, 1], SamplingParams(temperature=0, max_tokens=50))
    _emit(near_end)
    near_end.output_token_ids = [0] * 48  # two tokens left of max_tokens=50: one draft at most
    assert always.propose(near_end) == [2]


def test_a_draft_models_low_acceptance_pauses_it():
    """A draft model's proposals cost a run of the draft: a verification that leaves the
    score below the floor pauses the request for FIRST_PAUSE steps, doubling while it
    stays below, and back to FIRST_PAUSE once its verifications pay."""
    req = Request("r", [1, 2, 1, 2, 1], SamplingParams(temperature=0, max_tokens=50))
    _emit(req)
    config = SpeculativeConfig(**NGRAM, min_tokens_per_verification=2.5)
    proposer = DraftModelProposer(config, 96, draft=None)
    assert proposer.limit(req) == 3  # verified from the start (no lookup to watch)
    proposer.record(req, 3, 3)  # score 1.5: pays
    assert req.spec.pause == 0
    proposer.record(req, 3, 0)  # score 0.75
    assert req.spec.pause == FIRST_PAUSE
    assert [proposer.limit(req) for _ in range(FIRST_PAUSE)] == [0] * FIRST_PAUSE
    assert proposer.limit(req) == 3  # back after the pause
    proposer.record(req, 3, 1)  # still below: a longer pause
    assert req.spec.pause == 2 * FIRST_PAUSE
    req.spec.pause = 0
    proposer.record(req, 3, 3)
    proposer.record(req, 3, 3)  # pays again
    assert req.spec.pause == 0 and req.spec.next_pause == FIRST_PAUSE


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    """(speculating on every lookup, plain, speculating with the default floor: watching
    lookups until they pay) compiled engines on the tiny model, one compile cache."""
    config = {"cache_dir": str(tmp_path_factory.mktemp("spec_cache"))}
    made = [LLM(str(tiny_llama[0]), speculative_config=spec, compilation_config=config,
                kv_cache_memory=1 << 20, **ENGINE)
            for spec in (VERIFY_ALL, None, NGRAM)]  # fmt: skip
    return tuple(made)


def _prompts(rng, count: int) -> list[list[int]]:
    """Prompts that repeat phrases (so lookups find drafts, right and wrong)."""
    prompts = []
    for _ in range(count):
        phrases = [rng.integers(3, 300, rng.integers(2, 6)).tolist() for _ in range(3)]
        prompts.append([t for _ in range(4) for t in phrases[rng.integers(0, 3)]])
    return prompts


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tokens_equal_without_speculation(engines, batch):
    """20 prompts, one at a time and 8 at a time: the same tokens, finish reasons and
    texts; drafts both accepted and rejected; every KV block free afterwards. With the
    default floor (lookups watched until they pay) too, fewer drafts verified."""
    spec, plain, watching = engines
    prompts = _prompts(np.random.default_rng(batch), 20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = []
    for i in range(0, len(prompts), batch):
        want += [(t, r) for t, r, _ in completions(plain, prompts[i : i + batch], params)]
    drafted = {}
    for llm in (spec, watching):
        got, drafted[llm], accepted = [], 0, 0
        for i in range(0, len(prompts), batch):
            outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            got += [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
            drafted[llm] += sum(o.metrics.num_draft_tokens for o in outs)
            accepted += sum(o.metrics.num_accepted_tokens for o in outs)
        assert got == want
        assert 0 < accepted < drafted[llm]
        assert all_blocks_free(llm)
    assert drafted[watching] < drafted[spec]


REGEX = "(ab|cd|ef| )+"


@pytest.mark.slow
def test_structured_outputs_speculate_and_keep_their_tokens(engines):
    """A request under a grammar speculates: its drafts stop before the first token the
    grammar refuses, and each verification row is masked by the grammar's state after the
    drafts before it, so greedy tokens equal plain decoding's (the grammar's own masks,
    one token a step) and every output keeps to the grammar; sampled ones too."""
    import re

    from runtime.structured_output import StructuredOutputsParams

    spec, plain, _ = engines
    grammar = StructuredOutputsParams(regex=REGEX)
    prompts = ["ab cd ab cd ab", "ef ef ab ab ef ef", "cd ab ef cd ab ef", "x y z"]
    prefix = "((ab|cd|ef| )*)(a|c|e)?"  # where a request stopped at max_tokens
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=4, max_tokens=24,
                                structured_outputs=grammar)  # fmt: skip
        got = spec.generate(prompts, params, use_tqdm=False)
        for out in got:
            o = out.outputs[0]
            assert re.fullmatch(REGEX if o.finish_reason == "stop" else prefix, o.text), o.text
        if temperature == 0.0:
            want = plain.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
            assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    assert all_blocks_free(spec)


def test_a_grammars_verification_rows_take_its_state_after_each_draft(engines):
    """`GrammarState.mask_rows`: row i's mask is the grammar's after drafts[:i] (another
    matcher advanced token by token), and the matcher is left where it was; drafts are cut
    before the first token the grammar refuses (`allowed_prefix`)."""
    from runtime.structured_output import StructuredOutputsParams

    engine = engines[0].llm_engine
    grammar = StructuredOutputsParams(regex=REGEX)
    state, other = engine.grammars().matcher(grammar), engine.grammars().matcher(grammar)
    tokenizer = engine.tokenizer
    drafts = tokenizer.encode("ab cd", add_special_tokens=False)
    refused = tokenizer.encode("xy", add_special_tokens=False)
    assert state.allowed_prefix(drafts + refused + drafts) == drafts
    vocab = state.vocab_size
    rows = torch.zeros(len(drafts) + 1, vocab)
    state.mask_rows(rows, drafts)
    for i in range(len(drafts) + 1):
        want = torch.zeros(vocab)
        other.mask(want)
        assert torch.equal(rows[i] == float("-inf"), want == float("-inf")), i
        if i < len(drafts):
            assert other.accept(drafts[i])
    again = torch.zeros(vocab)
    state.mask(again)
    assert torch.equal(again, rows[0])  # rolled back
    # the proposer's lookups under a grammar: cut before the refused token
    params = SamplingParams(temperature=0, max_tokens=50, structured_outputs=grammar)
    req = Request("g", drafts + refused + drafts, params)
    req.grammar = engine.grammars().matcher(grammar)
    _emit(req)
    always = Proposer(SpeculativeConfig(**VERIFY_ALL), 96)
    assert ngram_proposal(req.all_token_ids, 3, 1, 3)[: len(refused)] == refused
    assert always.propose(req) == []  # the lookup's first token is refused
    with_logit_bias = SamplingParams(temperature=0, structured_outputs=grammar, logit_bias={5: 1.0})
    assert not Request("b", [1], with_logit_bias).plain_but_grammar


@pytest.mark.slow
def test_verifications_replay_the_decode_graphs(tiny_llama, tmp_path_factory):
    """A step of verifications (every row a logits row) runs as decodes, a sequence a
    token (`rows_as_decodes`), so it replays the CPU graph of its token count: on a Q8_0
    file (every product a recorded call at any row count; a float model's batched GEMMs
    are not), after drafting, every step but the prefill replays a graph, and the tokens
    equal plain decoding's."""
    from compilecore.counters import compilation_counter
    from runtime.model_runner import rows_as_decodes
    from tests.gguf_files import Q, write_gguf

    path = tmp_path_factory.mktemp("spec_graphs") / "q8.gguf"
    write_gguf(path, tiny_llama[1], {}, Q.Q8_0)
    spec, plain = (LLM(str(path), speculative_config=s, skip_tokenizer_init=True,
                       kv_cache_memory=1 << 20, **ENGINE) for s in (VERIFY_ALL, None))  # fmt: skip
    if not spec.llm_engine.runner.cpu_graph_sizes:
        pytest.skip("no CPU graphs on this CPU (our kernels do not build)")
    steps, run_step = [], spec.llm_engine.executor.execute
    spec.llm_engine.executor.execute = lambda plan, *a: steps.append(plan) or run_step(plan, *a)
    prompts = _prompts(np.random.default_rng(5), 2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in prompts:
        spec.generate([prompt], params, use_tqdm=False)  # capture the sizes it meets
    replays = compilation_counter.num_cpu_graph_replays
    steps.clear()
    outs = spec.generate(prompts[:1], params, use_tqdm=False)
    verifications = [p for p in steps if rows_as_decodes(p) is not None]
    assert outs[0].metrics.num_draft_tokens > 0 and verifications
    assert compilation_counter.num_cpu_graph_replays - replays == len(steps) - 1  # no prefill
    want = plain.generate(prompts[:1], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.slow
@testing.settings(max_examples=6)
@given(
    lengths=st.lists(st.integers(4, 16), min_size=1, max_size=5),
    max_tokens=st.lists(st.integers(1, 20), min_size=5, max_size=5),
    stop_at=st.one_of(st.none(), st.integers(0, 19)),
    seed=st.integers(0, 2**16),
)
def test_stops_and_mixed_requests_equal_without_speculation(
    engines, lengths, max_tokens, stop_at, seed
):
    """Greedy requests that speculate beside a seeded sampled one (speculating too) and
    one with logprobs (which does not), each with its own max_tokens, a stop token the
    plain run emits, and a stop string: what each greedy request gives is the plain
    engine's, and the sampled one gives the same tokens when run again (its own draws)."""
    spec, plain, _ = engines
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng, len(lengths))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    params = params[: len(prompts)]
    want = completions(plain, prompts, params)
    if stop_at is not None:
        tokens = want[0][0]
        stop = tokens[min(stop_at, len(tokens) - 1)]
        params[0] = SamplingParams(temperature=0, max_tokens=max_tokens[0], ignore_eos=True,
                                   stop_token_ids=[stop])  # fmt: skip
        if want[0][2]:
            params[-1] = SamplingParams(temperature=0, max_tokens=20, stop=[want[0][2][-3:]])
    prompts += [prompts[0], prompts[-1]]
    params += [SamplingParams(temperature=0.8, seed=seed, max_tokens=12),
               SamplingParams(temperature=0, logprobs=2, max_tokens=12)]  # fmt: skip
    got = completions(spec, prompts, params)
    want = completions(plain, prompts, params)
    assert got[:-2] + got[-1:] == want[:-2] + want[-1:]
    assert completions(spec, prompts, params)[-2] == got[-2]
    assert all_blocks_free(spec)


@pytest.mark.slow
def test_preemption_under_speculation(tiny_llama, engines):
    """A KV cache too small for the batch: requests are preempted (drafted slots count
    against the blocks) and recomputed, with the plain engine's tokens."""
    _, plain, _ = engines
    small = LLM(str(tiny_llama[0]), speculative_config=VERIFY_ALL, kv_cache_memory=60 << 10,
                enforce_eager=True, **ENGINE)  # fmt: skip
    prompts = _prompts(np.random.default_rng(7), 6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert completions(small, prompts, params) == completions(plain, prompts, params)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert small.llm_engine.spec_counts["num_accepted_tokens"] > 0
    assert all_blocks_free(small)


@pytest.fixture(scope="module")
def draft_engines(tiny_llama, tmp_path_factory):
    """Speculating engines whose drafts come from a draft model: the model itself, and
    another (its weights with noise on the last layer's MLP: it agrees on some tokens)."""
    import copy

    other = tmp_path_factory.mktemp("other_draft")
    hf = copy.deepcopy(tiny_llama[1])
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for w in hf.model.layers[-1].mlp.parameters():
            w.add_(torch.randn(w.shape, generator=g) * 0.3 * w.std())
    hf.save_pretrained(other)
    config = {"cache_dir": str(tmp_path_factory.mktemp("draft_cache"))}
    return tuple(
        LLM(str(tiny_llama[0]), compilation_config=config, kv_cache_memory=1 << 20,
            speculative_config={"model": str(draft), "num_speculative_tokens": 3}, **ENGINE)
        for draft in (tiny_llama[0], other)
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
def test_a_draft_model_keeps_greedy_tokens(engines, draft_engines, batch):
    """20 prompts one and 8 at a time with a draft model (vLLM's {"model": ...}): the plain
    engine's tokens and finish reasons; the model as its own draft has every draft
    accepted, another model some and not others; no KV block held in either engine."""
    _, plain, _ = engines
    prompts = _prompts(np.random.default_rng(10 + batch), 20)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [(t, r) for i in range(0, 20, batch)
            for t, r, _ in completions(plain, prompts[i : i + batch], params)]  # fmt: skip
    rates = []
    for llm in draft_engines:
        got, drafted, accepted = [], 0, 0
        for i in range(0, len(prompts), batch):
            outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            got += [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
            drafted += sum(o.metrics.num_draft_tokens for o in outs)
            accepted += sum(o.metrics.num_accepted_tokens for o in outs)
        assert got == want
        drafts = llm.llm_engine.proposer.draft.scheduler.block_manager
        assert all_blocks_free(llm) and drafts.num_free_blocks == drafts.num_blocks
        rates.append((accepted, drafted))
    itself, other = rates
    assert itself[1] > 0 and itself[0] == itself[1]
    assert 0 < other[0] < other[1]


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from tests.helpers import llama_config, save_checkpoint

    save_checkpoint(tmp_path, llama_config(vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        LLM(str(tiny_llama[0]), speculative_config={"model": str(tmp_path)},
            enforce_eager=True, **ENGINE)  # fmt: skip


@pytest.mark.parametrize(
    "value, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
        ({"model": "path/to/draft", "num_speculative_tokens": 2}, "path/to/draft"),
        ({"method": "ngram", "model": "path/to/draft"}, "method 'ngram' none"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max=2"),
        ({"min_tokens_per_verification": 0.5}, "min_tokens_per_verification must be"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_configs_are_named(tiny_llama, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(str(tiny_llama[0]), speculative_config=value, enforce_eager=True, **ENGINE)


def test_speculation_with_async_scheduling_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(tiny_llama[0]), speculative_config=NGRAM, async_scheduling=True,
            enforce_eager=True, **ENGINE)  # fmt: skip


def test_cli_metrics_and_report(engines, capsys):
    """`--speculative-config` reaches the engine arguments; /metrics counts the engine's
    totals under vLLM's names (added as they grow); `generate -v` prints the rate."""
    from runtime.cli import _engine_args, _report, build_parser
    from runtime.entrypoints.metrics import ServerMetrics

    line = [
        "serve",
        "x",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4}',
    ]
    assert _engine_args(build_parser().parse_args(line))["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 4}  # fmt: skip
    metrics = ServerMetrics()
    stats = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
    metrics.render({**stats, "num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 4})
    text = metrics.render({**stats, "num_drafts": 3, "num_draft_tokens": 9,
                           "num_accepted_tokens": 5})  # fmt: skip
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="model"} 9.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="model"} 5.0' in text
    spec, _, _ = engines
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    out = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    m = out.metrics
    assert m.num_drafts > 0 and 0 <= m.num_accepted_tokens <= m.num_draft_tokens
    assert m.mean_acceptance_length == 1 + m.num_accepted_tokens / m.num_drafts
    _report(out)
    assert f"drafts accepted {m.acceptance_rate:.0%}" in capsys.readouterr().err


def _chi_square_sf(stat: torch.Tensor, df: int) -> float:
    """P(chi-square with `df` degrees of freedom >= stat)."""
    return torch.special.gammaincc(torch.tensor(df / 2.0, dtype=stat.dtype), stat / 2).item()


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P-value of a chi-square goodness-of-fit test (categories with expected > 0)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token drawn that has probability 0"
    obs, exp = observed[keep].double(), expected[keep].double()
    return _chi_square_sf(((obs - exp) ** 2 / exp).sum(), len(obs) - 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_rule_keeps_each_rows_distribution(seed):
    """20000 verifications of two fixed drafts against three random rows: the first
    emitted token has row 0's distribution, the second (after draft 1 was kept) row 1's,
    the third (after both) row 2's; a draft of probability 0 is never kept."""
    g = torch.Generator().manual_seed(seed)
    vocab = 6
    probs = (torch.randn(3, vocab, generator=g) * 1.5).softmax(-1)
    probs[1, 4] = 0.0  # row 1 filtered a token out
    probs[1] /= probs[1].sum()
    drafts = [int(probs[0].argmax()), 4 if seed == 0 else int(probs[1].argmin())]
    counts = torch.zeros(3, vocab)
    reached = torch.zeros(3)
    for _ in range(20000):
        out = sample_verified(probs, drafts, lambda: torch.rand(1, generator=g).item())
        for i, token in enumerate(out):
            counts[i, token] += 1
            reached[i] += 1
        assert out[: len(out) - 1] == drafts[: len(out) - 1]
    for i in range(3):
        if reached[i] >= 200:
            assert _chi_square_p(counts[i], probs[i] * reached[i]) > 1e-3, (i, counts[i])
    if seed == 0:
        assert reached[2] == 0  # draft 2 had probability 0 at row 1


@pytest.mark.slow
def test_sampled_speculation_matches_plain_sampling_in_distribution(engines):
    """300 seeded requests (temperature 0.7, top-k 4) on a prompt ending in the run of
    one token that the model's greedy continuation repeats (so drafts are often right):
    the second and third tokens' distributions with speculation equal plain sampling's
    (two-sample chi-square), and drafts were both kept and refused."""
    spec, plain, _ = engines
    start = [5 + i % 7 for i in range(30)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    run = plain.generate([start], greedy, use_tqdm=False)[0].outputs[0].token_ids
    prompt = start + run
    params = [SamplingParams(temperature=0.7, top_k=4, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(300)]  # fmt: skip
    runs = {}
    for name, llm in (("spec", spec), ("plain", plain)):
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        if name == "spec":
            accepted = sum(o.metrics.num_accepted_tokens for o in outs)
            drafted = sum(o.metrics.num_draft_tokens for o in outs)
            assert 0 < accepted < drafted
    for position in (1, 2):
        tokens = sorted({t[position] for run in runs.values() for t in run})
        table = torch.tensor(
            [[sum(t[position] == v for t in runs[name]) for v in tokens] for name in runs],
            dtype=torch.float64,
        )
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        p = _chi_square_sf(((table - expected) ** 2 / expected).sum(), len(tokens) - 1)
        assert p > 1e-3, (position, table)


@pytest.mark.slow
def test_greedy_speculation_is_exact_in_batch_invariant_mode(tiny_gguf, tmp_path_factory):
    """On quantized weights the k + 1-row products and attention sum in another order than
    a one-token step, so tokens may differ at a near-tie; in batch-invariant mode every
    product and each verified row's attention take the bits decoding gives them, so the
    tokens equal plain decoding's in that mode: 12 prompts, 8 at a time."""
    cc = {"batch_invariant": True, "cache_dir": str(tmp_path_factory.mktemp("spec_bi"))}
    engines = [LLM(str(tiny_gguf[0]), speculative_config=spec, compilation_config=cc,
                   skip_tokenizer_init=True, **ENGINE)
               for spec in (VERIFY_ALL, None)]  # fmt: skip
    prompts = _prompts(np.random.default_rng(11), 12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = engines[0].generate(prompts[:8], params, use_tqdm=False)
    got += engines[0].generate(prompts[8:], params, use_tqdm=False)
    want = engines[1].generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert 0 < accepted < sum(o.metrics.num_draft_tokens for o in got)


@pytest.mark.slow
def test_a_draft_models_sequence_lives_as_long_as_its_request(draft_engines):
    """A request keeps one sequence in the draft engine from its first proposal to its end:
    each later proposal rewinds it over the rejected drafts and computes what verification
    emitted, never the request again (before, each proposal was a new draft request that
    prefilled up to a block of tokens piece by piece: 0.42-0.51x plain decoding with a
    92-96% acceptance); its KV goes back when the request finishes or is aborted."""
    engine = draft_engines[1].llm_engine  # another model: some drafts rejected
    proposer, draft = engine.proposer, engine.proposer.draft
    prompts = _prompts(np.random.default_rng(3), 2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))
    seen, lengths = {}, {f"r{i}": len(p) for i, p in enumerate(prompts)}
    while engine.has_unfinished_requests():
        engine.step()
        for rid, seq in proposer.sequences.items():
            seen.setdefault(rid, seq.request_id)
            assert seq.request_id == seen[rid]  # the same sequence all along
            assert seq.num_computed_tokens >= lengths[rid]  # never the prompt again
        assert all(seq.held for seq in proposer.sequences.values())
    assert set(seen) == {"r0", "r1"}
    for rid in seen:
        engine.release(rid)
    assert proposer.sequences == {} and draft.requests == {}
    blocks = draft.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    engine.add_request(Request("gone", prompts[0], params))
    for _ in range(3):
        engine.step()
    assert "gone" in proposer.sequences
    engine.abort_request("gone")
    assert proposer.sequences == {} and blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.slow
def test_a_draft_model_up_to_the_models_length(engines, draft_engines):
    """Requests that reach max_model_len while drafting (a draft sequence runs a token past
    its drafts): the plain engine's tokens and finish reasons, no draft block held."""
    _, plain, _ = engines
    prompts = [list(range(3, 93)), list(range(5, 98 - 5))]  # 90 and 88 of 96 tokens
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [(t, r) for t, r, _ in completions(plain, prompts, params)]
    assert {r for _, r in want} == {"length"}
    for llm in draft_engines:
        assert [(t, r) for t, r, _ in completions(llm, prompts, params)] == want
        drafts = llm.llm_engine.proposer.draft.scheduler.block_manager
        assert drafts.num_free_blocks == drafts.num_blocks
