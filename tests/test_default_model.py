"""The embedded default model (SmolLM2-135M-Instruct) against HF transformers."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import default_model
from tests.helpers import (
    hf_greedy,
    hf_greedy_checked,
    hf_logits,
    load_ours,
    native_cpu_kernels,
    native_quantized_products,
    packed_logits,
)

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_default(default_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompt(default_model_dir):
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_auto_dtype_of_the_default_model_is_bf16(default_model_dir):
    from runtime.llm import build_engine_config

    config = build_engine_config(str(default_model_dir))
    assert config.model_config.dtype == torch.bfloat16


def test_converted_folder_is_complete(default_model_dir):
    assert default_model_dir == default_model.default_model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (default_model_dir / name).is_file()
    # Converted atomically: no temporary folders are left beside it.
    leftovers = [p for p in default_model_dir.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_prefill_logits_match_hf(default_model_dir, hf_default, chat_prompt):
    ours, engine_config = load_ours(default_model_dir)
    prompt = torch.tensor(chat_prompt)
    got = packed_logits(ours, engine_config, [prompt])
    want = hf_logits(hf_default, [prompt])
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_answer_matches_hf(default_model_dir, hf_default, chat_prompt):
    from runtime import LLM, SamplingParams

    llm = LLM(str(default_model_dir), dtype="float32", enforce_eager=True, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([chat_prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_default, chat_prompt, 32)
    assert out.text.startswith("The capital of France is Paris.")


# The benchmark's configuration (compiled, bf16, CPU graph) against HF in bf16: greedy tokens
# must agree up to the first step where HF's own top-2 logits are closer than MARGIN (two
# bf16 steps at the logits' magnitude), where rounding may legitimately pick either.
MARGIN = 0.25
PROMPTS = ["1, 2, 3, 4, 5, 6,", "The capital of France is", "Photosynthesis is the process by"]


def _hf_bf16_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], int]:
    return hf_greedy_checked(hf, prompt, n, MARGIN)


def test_benchmarked_bf16_config_matches_hf_bf16(default_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from compilecore.cpu_graph import CpuGraph
    from runtime import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompts = [tok.encode(p) for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.bfloat16)
    hf.eval().generation_config.eos_token_id = None
    wanted = [_hf_bf16_greedy(hf, p, 48) for p in prompts]
    assert sum(checked for _, checked in wanted) >= 40, "near ties too early: nothing to check"

    llm = LLM(
        str(default_model_dir), dtype="bfloat16", max_model_len=512,
        compilation_config={"cache_dir": str(tmp_path)},
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt, (want, checked) in zip(prompts, wanted):  # one at a time: batch 1, the graph
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got[:checked] == want[:checked]
    assert isinstance(llm.llm_engine.runner.cpu_graphs[1], CpuGraph)
    # The throughput and serving benchmarks' batches: decode at 12 rows (`packed_mm`).
    outs = llm.generate(prompts * 4, params, use_tqdm=False)
    for out, (want, checked) in zip(outs, wanted * 4):
        assert out.outputs[0].token_ids[:checked] == want[:checked]
    # (without AVX-512 the compiler alone runs batched products: piece by piece)
    assert isinstance(llm.llm_engine.runner.cpu_graphs[12], CpuGraph) == native_cpu_kernels()


# The shipped file run from its blocks (the default model's main path) against HF's fp32
# dequantization of the same file (the converted folder holds exactly those values).
GGUF_PROMPTS = PROMPTS + [
    "The three primary colors are", "Water boils at a temperature of", "def add(a, b):",
    "Once upon a time, in a small village,", "The largest planet in the solar system is",
]  # fmt: skip
# bf16 activations and int8 activations in the products (the integer path): HF fp32's top-2
# closer than this may legitimately go either way.
GGUF_MARGIN = 0.5


def test_shipped_gguf_logits_match_hf_fp32(hf_default, chat_prompt):
    """fp32 activations: the blocks are read in fp32, so the logits agree with HF's on
    the dequantized weights within fp32 rounding."""
    from models import gguf
    from models.loader import load_hf_config

    path = default_model.find_gguf()
    hf_config = load_hf_config(gguf.metadata_dir(path))
    ours, engine_config = load_ours(path, quant_config=gguf.quant_config(path),
                                    hf_config=hf_config)  # fmt: skip
    prompt = torch.tensor(chat_prompt)
    got = packed_logits(ours, engine_config, [prompt])
    want = hf_logits(hf_default, [prompt])
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_shipped_gguf_native_greedy_matches_hf_fp32(default_model_dir, hf_default, tmp_path):
    """The default model as `LLM()` runs it (compiled, bf16, the quantized products in CPU
    graphs at batch 1 and 8) against HF fp32 on the same weights, up to the first near
    tie, on 8 prompts."""
    from transformers import AutoTokenizer

    from compilecore.counters import compilation_counter
    from compilecore.cpu_graph import CpuGraph
    from runtime import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompts = [tok.encode(p) for p in GGUF_PROMPTS]
    hf_default.generation_config.eos_token_id = None
    wanted = [hf_greedy_checked(hf_default, p, 24, GGUF_MARGIN) for p in prompts]
    assert sum(checked for _, checked in wanted) >= 40, "near ties too early: nothing to check"
    # One Dynamo graph, cut at the 30 attentions into 61 pieces.
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=61):
        llm = LLM(max_model_len=512, compilation_config={"cache_dir": str(tmp_path)})
    assert llm.engine_config.model_config.quant_config.name == "gguf"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt, (want, checked) in zip(prompts, wanted):
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got[:checked] == want[:checked]
    assert isinstance(llm.llm_engine.runner.cpu_graphs[1], CpuGraph)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (want, checked) in zip(outs, wanted):
        assert out.outputs[0].token_ids[:checked] == want[:checked]
    # (its products from the blocks: native calls with AVX-512 or AVX2, recorded)
    assert isinstance(llm.llm_engine.runner.cpu_graphs[8], CpuGraph) == native_quantized_products()
    # Perplexity the way llama-perplexity computes it (benchmarks/perplexity.py), within 1%
    # of HF fp32's on the same chunks.
    ppl = _load_benchmark("perplexity")
    tokens = ppl.text_tokens(llm)
    ours = ppl.perplexity(llm, tokens, 128)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for chunk in ppl.chunks(tokens, 128):
            logp = hf_default(torch.tensor([chunk])).logits[0].float().log_softmax(-1)
            nll -= sum(logp[i - 1, chunk[i]].item() for i in range(65, 128))
            count += 63
    want = math.exp(nll / count)
    assert abs(ours / want - 1) <= 0.01, (ours, want)


def _load_benchmark(name: str):
    folder = Path(__file__).parent.parent / "benchmarks"
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
