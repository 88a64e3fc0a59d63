"""Bad input gets a clear error before any work, and the engine keeps serving."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from torch import fx

from models.llama import LlamaForCausalLM
from models.loader import ModelLoadError
from passes import GraphPass
from runtime import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=64)


@pytest.mark.parametrize(
    "prompts, error, match",
    [
        ("", ValueError, "prompt 0 is empty"),
        (["ok", ""], ValueError, "prompt 1 is empty"),
        ([[1, 2, 99999]], ValueError, "token id 99999 is outside the vocabulary"),
        ([[1, -5]], ValueError, "token id -5"),
        ([list(range(3, 70))], ValueError, "67 tokens, but max_model_len=64"),
        (42, TypeError, "prompts must be"),
        ([3.5], TypeError, "prompt 0 must be"),
        ([[1, "a"]], TypeError, "token ids must be integers"),
        ([{"text": "x"}], ValueError, "needs 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_bad_prompt_raises_and_engine_keeps_serving(llm, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing half-added
    out = llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY], use_tqdm=False)


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match=str(tmp_path / "absent")):
        LLM(str(tmp_path / "absent"))


def test_unknown_architecture_names_folder_and_arch(tmp_path, tiny_llama):
    import shutil

    shutil.copytree(tiny_llama[0], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"m: unknown architecture 'MysteryForCausalLM'"):
        LLM(str(tmp_path / "m"))


def test_corrupt_weights(tmp_path, tiny_llama):
    import shutil

    shutil.copytree(tiny_llama[0], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(tmp_path / "m"))


def test_kv_budget_too_small_says_what_is_needed(tiny_llama):
    with pytest.raises(ValueError, match=r"needs 4 blocks \(32768 bytes\)"):
        LLM(str(tiny_llama[0]), max_model_len=64, kv_cache_memory=8192)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 100000}, "exceeds the model's max_position_embeddings=512"),
        ({"dtype": "int8"}, "dtype='int8' is not supported"),
        ({"compilation_config": {"bogus": 1}}, "unknown fields"),
        ({"compilation_config": {"cudagraph_mode": "FULL"}}, "one of NONE, PIECEWISE, FULL_DEC"),
    ],
)
def test_bad_engine_arguments(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama[0]), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_a_cuda_device_without_cuda_is_refused_by_name(tiny_llama):
    with pytest.raises(ValueError, match=r"device='cuda:1': no CUDA device.*'cpu'"):
        LLM(str(tiny_llama[0]), device="cuda:1")


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt.startswith("<s>user: hi") and out.prompt.endswith("<s>assistant:")


class _FailingPass(GraphPass):
    """A user pass that fails while the engine compiles: after the weights are loaded."""

    name = "fails_at_compile"

    def __call__(self, graph: fx.Graph) -> int:
        raise RuntimeError("this pass always fails")


def _live_models() -> int:
    gc.collect()
    return sum(type(o) is LlamaForCausalLM for o in gc.get_objects())


def test_a_failed_start_keeps_nothing_alive_through_its_error(tiny_llama):
    """A caller that keeps the error (a notebook's last traceback, a retry loop) must not
    keep the failed engine's weights, KV cache and compiled code with it."""
    before = _live_models()
    with pytest.raises(Exception, match="this pass always fails") as info:
        LLM(str(tiny_llama[0]), compilation_config={"custom_passes": [_FailingPass()]})
    assert info.value.__traceback__ is not None  # the error and its traceback are kept
    assert _live_models() == before
