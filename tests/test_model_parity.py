"""Our model vs HF transformers on the same weights: logits over a packed batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import MistralConfig, Qwen2Config

from tests.helpers import hf_logits, llama_config, load_ours, packed_logits, save_checkpoint

LENGTHS = [7, 1, 13, 4]


def _prompts(vocab: int, lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _check(tmp_path, config, *, dtype=torch.float32, rel_tol=1e-4, max_shard_size=None):
    hf = save_checkpoint(tmp_path, config, dtype=dtype, max_shard_size=max_shard_size)
    ours, engine_config = load_ours(tmp_path, dtype=dtype)
    prompts = _prompts(config.vocab_size)
    got = packed_logits(ours, engine_config, prompts)
    if dtype != torch.float32:
        hf = hf.to(dtype)
    want = hf_logits(hf, prompts)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= rel_tol * scale, "logits differ from HF"
    return got, want


CASES = {
    "mha": llama_config(num_key_value_heads=4),
    "gqa": llama_config(),
    "mqa": llama_config(num_key_value_heads=1),
    "head_dim_differs": llama_config(head_dim=32),
    "tied": llama_config(tie_word_embeddings=True),
    "llama3_rope": llama_config(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "rope_theta": llama_config(rope_theta=500000.0),
    "attention_and_mlp_bias": llama_config(attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_llama_matches_hf(tmp_path, name):
    _check(tmp_path, CASES[name])


def test_sharded_checkpoint(tmp_path):
    _check(tmp_path, llama_config(), max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()


def test_bf16_matches_hf_loosely(tmp_path):
    got, want = _check(tmp_path, llama_config(), dtype=torch.bfloat16, rel_tol=3e-2)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9


def test_qwen2_matches_hf(tmp_path):
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    _check(tmp_path, config)


def test_mistral_matches_hf(tmp_path):
    config = MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        sliding_window=None,
        architectures=["MistralForCausalLM"],
    )
    _check(tmp_path, config)


@st.composite
def small_llama_configs(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    return llama_config(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=heads * draw(st.sampled_from([8, 16])),
        intermediate_size=draw(st.sampled_from([32, 96])),
        num_hidden_layers=draw(st.integers(1, 3)),
        tie_word_embeddings=draw(st.booleans()),
    )


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(config=small_llama_configs(), lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4))
def test_drawn_configs_match_hf(tmp_path_factory, config, lengths):
    path = tmp_path_factory.mktemp("drawn")
    hf = save_checkpoint(path, config)
    ours, engine_config = load_ours(path)
    prompts = _prompts(config.vocab_size, lengths)
    got, want = packed_logits(ours, engine_config, prompts), hf_logits(hf, prompts)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
