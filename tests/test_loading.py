"""Weight loading from real safetensors files, and its errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.llama import WeightLoadError
from models.loader import ModelLoadError, load_hf_config
from tests.helpers import llama_config, load_ours, save_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    save_checkpoint(tmp_path, llama_config())
    return tmp_path


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(tmp_path / "nope")


def test_no_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_config(tmp_path)


def test_no_safetensors(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files"):
        load_ours(checkpoint)


def test_corrupt_file(checkpoint):
    file = checkpoint / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_ours(checkpoint)


def test_missing_weight_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_ours(checkpoint)


def test_unexpected_weight_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        WeightLoadError, match=r"unexpected weight 'model\.layers\.0\.extra\.weight'"
    ):
        load_ours(checkpoint)


def test_shape_mismatch_names_expected_and_got(checkpoint):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    _rewrite(checkpoint, shrink)
    with pytest.raises(WeightLoadError) as e:
        load_ours(checkpoint)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg
    assert "32" in msg and "(8, 64)" in msg


def test_missing_shard_named_by_index(tmp_path):
    save_checkpoint(tmp_path, llama_config(), max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(ModelLoadError, match=victim):
        load_ours(tmp_path)


def test_unknown_architecture(checkpoint):
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown architecture 'FancyNewForCausalLM'; supported: "):
        load_ours(checkpoint)


def test_dtype_chosen_at_load(checkpoint):
    model, _ = load_ours(checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # The rotary cache stays fp32 (it is derived, not loaded).
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_sin_cache.dtype == torch.float32


def test_a_hugging_face_id_resolves_from_the_local_cache(tiny_llama, tmp_path, monkeypatch):
    """LLM("org/name") as in vLLM, offline: the snapshot the cache's refs/main names (the
    layout `huggingface-cli download` leaves); an id the cache lacks says where it looked."""
    import shutil

    from runtime import LLM, SamplingParams

    hub = tmp_path / "hub"
    repo = hub / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_llama[0], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    llm = LLM("tiny-org/tiny-llama", enforce_eager=True)
    assert llm.engine_config.model_config.model == str(snapshot)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(ModelLoadError, match=f"local Hugging Face cache .{hub}"):
        LLM("tiny-org/not-downloaded", enforce_eager=True)
