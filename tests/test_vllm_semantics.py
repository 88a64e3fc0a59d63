"""vLLM's sampling semantics and an engine that survives failed requests.

Oracles: HF `generate(repetition_penalty=...)` for the repetition penalty, a direct
computation on the logits for the other penalties, logit bias and masks, a plain
re-implementation of vLLM's filter order for min-p / top-k / top-p, and the engine's own
greedy output for "keeps serving correctly" after a failure."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.llama import WeightLoadError
from runtime import LLM, Logprob, SamplingParams
from runtime.request import Request
from runtime.sampler import filter_logits, process_logits
from tests.helpers import llama_config, save_checkpoint

PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=128, max_logprobs=10**6)


@pytest.fixture(scope="module")
def reference(llm):
    return _greedy(llm)


def _greedy(llm: LLM, prompt=PROMPT, params=GREEDY) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def _idle(llm: LLM) -> None:
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests()
    assert engine.requests == {} and engine.detokenizers == {}
    assert bm.num_free_blocks == bm.num_blocks


# -- validation: a ValueError naming the field, before anything is queued ---------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**64 - 1, "n": 2}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"n": 2.0}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ],
)
def test_bad_values_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**kwargs)


def test_unknown_engine_arguments_are_named(tiny_llama):
    """A vLLM engine argument without a counterpart here is a ValueError naming it; a
    misspelt one a TypeError with the closest names (vLLM's LLM takes any EngineArgs)."""
    with pytest.raises(ValueError, match="'enable_lora' has no counterpart"):
        LLM(str(tiny_llama[0]), enforce_eager=True, enable_lora=True)
    with pytest.raises(TypeError, match="did you mean max_num_seqs"):
        LLM(str(tiny_llama[0]), enforce_eager=True, max_num_seq=4)


def test_vllm_spellings_frameworks_pass():
    """best_of equal to n (LangChain and others pass best_of=1), a repetition penalty above
    2 (vLLM bounds it only below), and clone() with lists of its own."""
    assert SamplingParams(best_of=1).n == 1 and SamplingParams(n=2, best_of=2).best_of == 2
    assert SamplingParams(repetition_penalty=3.0).repetition_penalty == 3.0
    params = SamplingParams(stop=["x"], logit_bias={1: 2.0}, n=2, best_of=2)
    twin = params.clone()
    twin.logit_bias[1] = 5.0
    assert params.logit_bias == {1: 2.0} and twin.stop == ["x"] and twin.best_of == 2
    assert params.for_sample(1).best_of is None
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"


def test_logprobs_minus_one_is_every_token(tiny_llama, llm):
    """vLLM's V1: logprobs=-1 (and prompt_logprobs=-1) return every token's logprob, under
    max_logprobs=-1; with a cap below the vocabulary it is a ValueError naming both."""
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    with pytest.raises(ValueError, match=r"logprobs=-1 \(every token: 320\) exceeds"):
        LLM(str(tiny_llama[0]), enforce_eager=True).generate([PROMPT], params)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]  # this LLM: a cap of 10**6
    assert all(len(entry) == 320 for entry in out.outputs[0].logprobs)
    assert all(len(entry) == 320 for entry in out.prompt_logprobs[1:])
    total = sum(math.exp(lp.logprob) for lp in out.outputs[0].logprobs[0].values())
    assert total == pytest.approx(1.0, abs=1e-4)


def test_logit_bias_keys_from_json_and_clamped():
    params = SamplingParams(logit_bias={"7": 250.0, 3: -1.5})
    assert params.logit_bias == {7: 100.0, 3: -1.5}


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(logprobs=21), "logprobs=21 exceeds max_logprobs=20"),
        (SamplingParams(logit_bias={10**6: 1.0}), "token id 1000000 is outside"),
        (SamplingParams(allowed_token_ids=[10**6]), "token id 1000000 is outside"),
    ],
)
def test_llm_checks_params_before_queuing(tiny_llama, params, match):
    llm = LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        llm.generate(["ok", "fine"], [GREEDY, params], use_tqdm=False)
    _idle(llm)
    assert len(_greedy(llm, params=GREEDY)) == 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"max_model_len": -4}, "max_model_len must be >= 1"),
        ({"distributed_executor_backend": "ray"}, "distributed_executor_backend='ray'"),
        ({"max_logprobs": -2}, "max_logprobs"),
        ({"compilation_config": {"cudagraph_capture_sizes": [1, 4096]}}, r"\[4096\] exceed"),
    ],
)
def test_bad_engine_args(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama[0]), enforce_eager=True, **kwargs)


# -- a failed request never breaks the LLM ---------------------------------------------
def test_request_failing_inside_a_step_leaves_the_llm_serving(llm, reference):
    # A logit bias on a token outside the vocabulary, added straight to the engine (the
    # LLM's checks refuse it): the sampler's indexing raises mid-step, next to a good request.
    engine, vocab = llm.llm_engine, llm.engine_config.model_config.hf_config.vocab_size
    bad = SamplingParams(logit_bias={vocab + 7: 1.0}, max_tokens=4)
    engine.add_request(Request("bad", llm._tokenize(0, "x"), bad))
    engine.add_request(Request("good", llm._tokenize(1, "y"), SamplingParams(max_tokens=4)))
    with pytest.raises(IndexError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "aborted the requests of the failed step" in notes or not hasattr(info.value, "add_note")
    _idle(llm)
    assert _greedy(llm) == reference


def test_logprobs_beyond_the_vocabulary_rank_every_token(llm):
    vocab = llm.engine_config.model_config.hf_config.vocab_size
    params = SamplingParams(logprobs=10**6, prompt_logprobs=10**6, max_tokens=2)
    out = llm.generate(["x y"], params, use_tqdm=False)[0]
    for entry in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert sorted(v.rank for v in entry.values()) == list(range(1, vocab + 1))
        assert math.fsum(math.exp(v.logprob) for v in entry.values()) == pytest.approx(1.0)


def test_interrupted_generate_leaves_the_llm_serving(llm, reference, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def interrupted_step():  # Ctrl-C arriving in the middle of generation
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, [9, 9, 9]], SamplingParams(max_tokens=20), use_tqdm=False)
    monkeypatch.undo()
    _idle(llm)
    assert _greedy(llm) == reference


def test_abort_request_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request(Request("to-abort", PROMPT * 4, SamplingParams(max_tokens=50)))
    engine.step()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks < bm.num_blocks
    engine.abort_request("to-abort")
    _idle(llm)


# -- stops ------------------------------------------------------------------------------
def test_min_tokens_masks_stop_tokens(llm, reference):
    first = reference[0]
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=3)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3]  # masked to -inf, not sampled and ignored


def test_a_stop_string_counts_only_past_min_tokens_like_vllm(llm, reference):
    """vLLM checks stop strings once the output is longer than min_tokens (stop tokens
    from min_tokens on): a string completed by the min_tokens-th token does not stop it."""
    text = llm.tokenizer.decode(reference[:3])
    stop = text[-2:] if len(text) >= 2 else text
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    early = llm.generate([PROMPT], base, use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    late = SamplingParams(**{**_fields(base), "min_tokens": len(early.token_ids)})
    out = llm.generate([PROMPT], late, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > len(early.token_ids)


def test_stop_token_text_is_left_out_unless_asked(llm, reference):
    stop = reference[2]
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[:3] and out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == llm.tokenizer.decode(reference[:2])
    keep = SamplingParams(**{**_fields(params), "include_stop_str_in_output": True})
    out = llm.generate([PROMPT], keep, use_tqdm=False)[0].outputs[0]
    assert out.text == llm.tokenizer.decode(reference[:3])


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__ if not k.startswith("_")}


# -- logits processing against direct computation -------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(8, 40),
    out_len=st.integers(0, 12),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(0.5, 2),
)
def test_penalties_and_bias_equal_direct_computation(
    device, seed, vocab, out_len, presence, frequency, repetition
):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (5,), generator=g).tolist()
    out = torch.randint(0, vocab, (out_len,), generator=g).tolist()
    bias = {int(torch.randint(0, vocab, (1,), generator=g)): 1.5}
    params = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition, logit_bias=bias,
    )  # fmt: skip
    req = Request("r", prompt, params)
    req.output_token_ids = list(out)
    got = logits.clone()[None].to(device)  # on CUDA: every index and value on the device
    process_logits(got, [req], frozenset())
    got = got.cpu()
    want = logits.clone()
    for t, b in bias.items():
        want[t] += b
    for t in set(prompt) | set(out):
        want[t] = want[t] / repetition if want[t] > 0 else want[t] * repetition
    for t in set(out):
        want[t] -= frequency * out.count(t) + presence
    assert torch.allclose(got[0], want, atol=1e-5)


def test_allowed_tokens_bad_words_and_min_tokens_masks():
    params = SamplingParams(allowed_token_ids=[1, 2, 3, 4], min_tokens=2, stop_token_ids=[3])
    req = Request("r", [0], params)
    req.bad_words_token_ids = [[2], [5, 4]]
    req.output_token_ids = [5]
    logits = torch.zeros(1, 8)
    process_logits(logits, [req], frozenset({1}))
    # 0, 5-7: not allowed; 2: a one-token bad word; 4: ends the bad word "5 4" after 5;
    # 1 (EOS) and 3 (stop token): masked before min_tokens
    assert torch.isinf(logits[0]).tolist() == [True] * 8
    req.output_token_ids = [5, 6]
    logits = torch.zeros(1, 8)
    process_logits(logits, [req], frozenset({1}))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 3, 4]


def _vllm_order(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float):
    """vLLM's order, written plainly over one row: temperature, min-p, top-k, then top-p
    on the distribution renormalized after top-k. Returns the set of tokens kept."""
    x = (logits / t).tolist()
    keep = set(range(len(x)))
    probs = torch.tensor(x).softmax(-1).tolist()
    if min_p > 0:
        keep = {i for i in keep if probs[i] >= min_p * max(probs)}
    order = sorted(keep, key=lambda i: -x[i])
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1:
        z = sum(math.exp(x[i] - x[order[0]]) for i in order)
        mass, kept = 0.0, []
        for i in order:
            if mass >= top_p:
                break
            kept.append(i)
            mass += math.exp(x[i] - x[order[0]]) / z
        order = kept
    return set(order)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(4, 30),
    t=st.floats(0.3, 2.0),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.1, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.2]),
)
def test_filter_order_equals_vllm(seed, vocab, t, top_k, top_p, min_p):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    got = filter_logits(logits[None].double(), [params])[0]
    kept = set(torch.isfinite(got).nonzero().flatten().tolist())
    assert kept == _vllm_order(logits.double(), t, top_k, top_p, min_p)


# -- against HF generate ----------------------------------------------------------------
def test_repetition_penalty_equals_hf_generate(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(str(path), enforce_eager=True, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4)
    got = _greedy(llm, params=params)
    ids = torch.tensor([PROMPT])
    hf.generation_config.eos_token_id = None
    want = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
        do_sample=False, repetition_penalty=1.4, pad_token_id=0,
    )[0, len(PROMPT):].tolist()  # fmt: skip
    assert got == want
    assert got != _greedy(llm, params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))


def test_logprobs_are_logprob_objects_with_ranks(llm, reference):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values())
        assert entry[token].rank == 1  # greedy: the sampled token ranks first
        assert sorted(v.rank for v in entry.values()) == [1, 2]
    total = sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids))
    assert out.cumulative_logprob == pytest.approx(total)


# -- model folders: generation_config.json, missing shards ------------------------------
def test_generation_config_defaults_and_extra_eos(tmp_path, tokenizer_dir, tiny_llama):
    save_checkpoint(tmp_path, llama_config(), tokenizer_dir=tokenizer_dir)
    llm0 = LLM(str(tmp_path), enforce_eager=True, max_model_len=64)
    first = _greedy(llm0, params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    extra_eos = first[3]
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
              "max_new_tokens": 6, "eos_token_id": [2, extra_eos]}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), enforce_eager=True, max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.9, 20)
    assert defaults.max_tokens == 6 and defaults.repetition_penalty == 1.0
    out = _greedy(llm, params=SamplingParams(temperature=0, max_tokens=6))
    assert out == first[: first.index(extra_eos) + 1]  # stopped at generation_config's EOS


def test_missing_shard_of_a_stacked_parameter_is_an_error(tmp_path, tokenizer_dir):
    from safetensors.torch import load_file, save_file

    save_checkpoint(tmp_path, llama_config(), tokenizer_dir=tokenizer_dir)
    weights = load_file(str(tmp_path / "model.safetensors"))
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        del weights[name]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="k_proj") as info:
        LLM(str(tmp_path), enforce_eager=True, max_model_len=64)
    assert "up_proj" in str(info.value)


def test_skip_tokenizer_init_takes_token_ids(tiny_llama, reference):
    llm = LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=128, skip_tokenizer_init=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate([PROMPT], SamplingParams(stop=["x"]), use_tqdm=False)


def test_prompt_logprobs_equal_hf_log_softmax(tiny_llama):
    path, hf = tiny_llama
    # A small token budget: the prompt arrives in chunks, rows come from several steps.
    llm = LLM(str(path), enforce_eager=True, max_model_len=128, max_num_batched_tokens=8)
    prompt = PROMPT + [11, 12, 13, 14, 15, 16, 17]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    res = llm.generate([prompt], params, use_tqdm=False)[0]
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for pos in range(1, len(prompt)):
        entry, token = res.prompt_logprobs[pos], prompt[pos]
        assert entry[token].logprob == pytest.approx(ref[pos - 1, token].item(), abs=1e-4)
        assert entry[token].rank == int((ref[pos - 1] > ref[pos - 1, token]).sum()) + 1
        top = ref[pos - 1].topk(2).indices.tolist()
        assert set(top) <= set(entry) and entry[top[0]].rank == 1
    # prefix caching stays correct: a second run recomputes the prompt rather than skip it
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [e and {t: v.logprob for t, v in e.items()} for e in again.prompt_logprobs] == [
        e and {t: v.logprob for t, v in e.items()} for e in res.prompt_logprobs
    ]
