"""The idioms of vLLM's offline examples (examples/offline_inference/*), written as a vLLM
user writes them, with only the import line changed (`from vllm import ...` ->
`from runtime import ...`). Each checks what the example relies on."""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_llama):
    return str(tiny_llama[0])


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model=model, enforce_eager=True, max_model_len=256, seed=0)


def test_basic_batch_with_default_sampling_params(llm):
    # examples/offline_inference/basic/generate.py
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 8
    outputs = llm.generate(prompts, sampling_params)
    assert [o.prompt for o in outputs] == prompts  # input order
    for output in outputs:
        generated_text = output.outputs[0].text
        assert isinstance(generated_text, str) and output.outputs[0].token_ids
        assert output.outputs[0].finish_reason in ("stop", "length")


def test_sampling_with_temperature_and_top_p(llm):
    # examples/offline_inference/basic/basic.py
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=42)
    first = llm.generate(["Hello, my name is"], sampling_params)
    again = llm.generate(["Hello, my name is"], sampling_params)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids  # seeded


def test_chat_on_a_list_of_conversations(llm):
    # examples/offline_inference/basic/chat.py
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    sampling_params = SamplingParams(temperature=0, max_tokens=6)
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    batch = llm.chat([conversation, conversation[:2]], sampling_params, use_tqdm=True)
    assert len(outputs) == 1 and len(batch) == 2
    assert batch[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    custom = llm.chat(conversation, sampling_params, chat_template=template, use_tqdm=False)
    assert custom[0].prompt.startswith("You are a helpful assistant\n")
    cont = llm.chat(
        conversation[:3], sampling_params, use_tqdm=False,
        add_generation_prompt=False, continue_final_message=True,
    )  # fmt: skip
    assert cont[0].prompt.rstrip().endswith("How can I assist you today?")


def test_logprobs(llm):
    sampling_params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=1)
    output = llm.generate("The capital of France is", sampling_params)[0]
    for token_id, logprobs in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
        assert token_id in logprobs and len(logprobs) >= 5
        best = max(logprobs.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1 and isinstance(best.decoded_token, str)
    assert output.prompt_logprobs[0] is None
    assert output.outputs[0].cumulative_logprob <= 0


def test_n_samples_with_a_seed(llm):
    sampling_params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6)
    outputs = llm.generate("Once upon a time", sampling_params)
    samples = [c.token_ids for c in outputs[0].outputs]
    assert len(samples) == 3 and [c.index for c in outputs[0].outputs] == [0, 1, 2]
    assert samples == [
        c.token_ids for c in llm.generate("Once upon a time", sampling_params)[0].outputs
    ]


def test_prompt_token_ids_inputs(llm):
    # examples/offline_inference/prompt_embed... / token-id prompts
    ids = llm.get_tokenizer().encode("The quick brown fox")
    greedy = SamplingParams(temperature=0, max_tokens=5)
    by_text = llm.generate("The quick brown fox", greedy)[0]
    by_ids = llm.generate({"prompt_token_ids": ids}, greedy)[0]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_ids.prompt_token_ids == ids and by_ids.prompt is None


def test_engine_args_of_vllm_scripts(model, llm):
    """The LLM(...) arguments vLLM scripts pass: the ones with an effect reach the config,
    the ones without one (swap_space, disable_log_stats) are accepted, and the engine
    answers as the plain one does."""
    tuned = LLM(
        model=model, enforce_eager=True, max_model_len=256, seed=0,
        gpu_memory_utilization=0.5, trust_remote_code=True, tokenizer_mode="auto",
        enable_chunked_prefill=False, max_num_batched_tokens=256, swap_space=0,
        disable_log_stats=True, kv_cache_dtype="auto", quantization=None,
    )  # fmt: skip
    config = tuned.engine_config
    assert config.cache_config.gpu_memory_utilization == 0.5
    assert not config.scheduler_config.enable_chunked_prefill
    greedy = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["Hello, my name is", "The capital of France is"]
    assert [o.outputs[0].token_ids for o in tuned.generate(prompts, greedy)] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, greedy)
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8' is not supported"),
        ({"quantization": "awq"}, "quantization='awq' is not supported"),
        ({"tokenizer_mode": "slow"}, "tokenizer_mode='slow' is not supported"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"swap_space": -1}, "swap_space must be"),
    ],
)
def test_vllm_engine_args_we_lack_say_so(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=model, enforce_eager=True, **kwargs)


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    ids = list(range(10, 300))  # longer than max_model_len=256
    greedy = dict(temperature=0, max_tokens=4)
    cut = SamplingParams(**greedy, truncate_prompt_tokens=20)
    kept = llm.generate({"prompt_token_ids": ids}, cut)
    last = llm.generate({"prompt_token_ids": ids[-20:]}, SamplingParams(**greedy))
    assert kept[0].prompt_token_ids == ids[-20:]
    assert kept[0].outputs[0].token_ids == last[0].outputs[0].token_ids
    longest = SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1)
    fits = llm.generate({"prompt_token_ids": ids}, longest)[0]
    assert fits.prompt_token_ids == ids[-255:] and len(fits.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens=300 is greater than max_model"):
        llm.generate("hi", SamplingParams(truncate_prompt_tokens=300))


def test_detokenize_false_gives_token_ids_only(llm):
    greedy = dict(temperature=0, max_tokens=5, logprobs=2)
    plain = llm.generate("The capital of France is", SamplingParams(**greedy))[0].outputs[0]
    ids_only = llm.generate("The capital of France is", SamplingParams(**greedy, detokenize=False))[
        0
    ].outputs[0]
    assert plain.text and ids_only.text == ""
    assert ids_only.token_ids == plain.token_ids
    assert all(lp.decoded_token is None for entry in ids_only.logprobs for lp in entry.values())
    spaced = SamplingParams(temperature=0, max_tokens=5, spaces_between_special_tokens=False)
    assert llm.generate("The capital of France is", spaced)[0].outputs[0].text == plain.text
