"""The engine's greedy tokens equal HF transformers' `generate`, token for token, under
every scheduling path: prefix caching, chunked prefill, preemption, n > 1."""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from tests.helpers import hf_greedy

NEW_TOKENS = 32
TEXTS = [
    "The quick brown fox",
    "Paris is the capital of France. Berlin is",
    "héllo 🙂",
    "def forward(self, x): return x + residual. Compilers turn programs into faster programs",
    "a",
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama[0]))
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    return [hf_greedy(tiny_llama[1], p, NEW_TOKENS) for p in prompts]


def _generate(path, prompts, params=GREEDY, **kwargs):
    llm = LLM(str(path), enforce_eager=True, **kwargs)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_batch_matches_hf(tiny_llama, prompts, expected, prefix_caching):
    _, outs = _generate(tiny_llama[0], prompts, enable_prefix_caching=prefix_caching)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_chunked_prefill_matches_hf(tiny_llama, prompts, expected):
    llm, outs = _generate(tiny_llama[0], prompts, max_num_batched_tokens=8)
    assert max(len(p) for p in prompts) > 8  # the long prompts really were chunked
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_preemption_matches_hf(tiny_llama, prompts, expected):
    # 6 blocks of 16 tokens for 5 requests of up to ~80 tokens: they must take turns.
    llm = LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=96, kv_cache_memory=6 * 8192)
    assert llm.engine_config.cache_config.num_gpu_blocks == 6
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 6


def test_n2_greedy_samples_both_match_hf(tiny_llama, prompts, expected):
    params = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    _, outs = _generate(tiny_llama[0], prompts[:2], params)
    for out, want in zip(outs, expected[:2]):
        assert [c.index for c in out.outputs] == [0, 1]
        assert [c.token_ids for c in out.outputs] == [want, want]


def test_prefix_cache_hits_and_still_matches_hf(tiny_llama, prompts):
    shared = prompts[3] * 2  # > 2 full blocks of 16 tokens
    variants = [shared + [5], shared + [9, 10]]
    llm = LLM(str(tiny_llama[0]), enforce_eager=True)
    first = llm.generate([variants[0]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([variants[1]], GREEDY, use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == (len(shared) // 16) * 16 > 0
    assert second.outputs[0].token_ids == hf_greedy(tiny_llama[1], variants[1], NEW_TOKENS)


def test_outputs_in_input_order_with_text(tiny_llama, prompts, expected):
    llm, outs = _generate(tiny_llama[0], TEXTS)
    assert [o.prompt for o in outs] == TEXTS
    assert [o.prompt_token_ids for o in outs] == prompts
    tok = llm.get_tokenizer()
    for out, want in zip(outs, expected):
        assert out.outputs[0].text == tok.decode(want, skip_special_tokens=True)
        assert out.metrics.time_to_first_token > 0
