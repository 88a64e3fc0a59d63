"""vLLM's model-file contract: prefixes, the attention registry, tensor-parallel slices,
pipeline-stage placeholders, and the errors for configurations we cannot run."""

from __future__ import annotations

import pytest
import torch

from compilecore.config import CompilationConfig, EngineConfig
from compilecore.parallel_state import GroupCoordinator, parallel_state
from models.interfaces import supports_pp
from models.layers.attention import Attention
from models.llama import LlamaForCausalLM, LlamaMLP
from models.loader import build_model, load_hf_config, load_weights
from models.registry import inspect_model, resolve_model_class, supported_architectures
from models.utils import IntermediateTensors, PPMissingLayer, extract_layer_index, get_pp_indices
from tests.helpers import hf_logits, llama_config, load_ours, packed_logits, save_checkpoint


def _engine_config(config, path=""):
    return EngineConfig.for_hf_config(
        config, model=str(path), compilation_config=CompilationConfig(mode="none")
    )


def test_prefix_equals_module_path():
    model = LlamaForCausalLM(engine_config=_engine_config(llama_config(num_hidden_layers=3)))
    checked = 0
    for name, module in model.named_modules():
        if hasattr(module, "prefix"):
            assert module.prefix == name
            checked += 1
    assert checked > 3 * 6  # every decoder layer, attention, MLP and linear has a prefix


def test_attention_registry_holds_every_layer_by_prefix():
    engine_config = _engine_config(llama_config(num_hidden_layers=3))
    LlamaForCausalLM(engine_config=engine_config)
    registry = engine_config.compilation_config.static_forward_context
    assert sorted(registry) == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert [extract_layer_index(p) for p in sorted(registry)] == [0, 1, 2]


def test_duplicate_layer_name_raises():
    engine_config = _engine_config(llama_config())
    Attention(4, 16, 0.25, engine_config=engine_config, prefix="model.layers.0.self_attn.attn")
    with pytest.raises(ValueError, match="Duplicate layer name: model.layers.0.self_attn.attn"):
        Attention(4, 16, 0.25, engine_config=engine_config, prefix="model.layers.0.self_attn.attn")


def test_heads_not_divisible_by_tp_size_raises():
    engine_config = _engine_config(llama_config(num_attention_heads=4, num_key_value_heads=4))
    with (
        parallel_state(GroupCoordinator(0, 3), GroupCoordinator()),
        pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible"),
    ):
        LlamaForCausalLM(engine_config=engine_config)


def test_non_silu_activation_raises():
    with pytest.raises(ValueError, match="Unsupported activation: gelu"):
        LlamaMLP(16, 32, "gelu", prefix="mlp")


def test_extract_layer_index_needs_exactly_one_number():
    with pytest.raises(ValueError, match="exactly one layer index"):
        extract_layer_index("model.layers.attn")


def test_registry_unknown_architecture_lists_supported():
    with pytest.raises(ValueError) as e:
        resolve_model_class("GPT2LMHeadModel")
    for name in supported_architectures():
        assert name in str(e.value)


def test_registry_reads_capability_markers():
    info = inspect_model("LlamaForCausalLM")
    assert info.supports_pp and info.supports_tp
    assert supports_pp(resolve_model_class("Qwen2ForCausalLM"))
    assert not supports_pp(torch.nn.Linear)


def test_pp_indices_cover_all_layers_once():
    for layers in range(2, 9):
        for size in range(1, layers + 1):
            ranges = [get_pp_indices(layers, r, size) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        get_pp_indices(2, 0, 3)


def _stage(path, pp_rank, pp_size=2):
    config = load_hf_config(path)
    engine_config = _engine_config(config, path)
    with parallel_state(GroupCoordinator(), GroupCoordinator(pp_rank, pp_size)):
        model = build_model(engine_config)
        load_weights(model, path)
    return model, engine_config


def test_pipeline_stage_keeps_names_and_builds_only_its_range(tmp_path):
    save_checkpoint(tmp_path, llama_config(num_hidden_layers=3))
    model, _ = _stage(tmp_path, pp_rank=1)
    kinds = [isinstance(layer, PPMissingLayer) for layer in model.model.layers]
    assert kinds == [True, True, False]
    assert isinstance(model.model.embed_tokens, PPMissingLayer)
    names = dict(model.named_parameters())
    assert "model.layers.2.self_attn.qkv_proj.weight" in names
    assert not any(n.startswith("model.layers.0.") for n in names)


def test_two_pipeline_stages_equal_the_whole_model(tmp_path):
    hf = save_checkpoint(tmp_path, llama_config(num_hidden_layers=3))
    first, cfg0 = _stage(tmp_path, pp_rank=0)
    last, cfg1 = _stage(tmp_path, pp_rank=1)
    from compilecore.forward_context import set_forward_context
    from runtime.attention import AttentionMetadata, DenseAttentionBackend

    for cfg in (cfg0, cfg1):
        for layer in cfg.compilation_config.static_forward_context.values():
            layer.bind(DenseAttentionBackend())
    prompt = torch.tensor([5, 9, 2, 7, 1])
    meta, positions = AttentionMetadata.dense([5]), torch.arange(5)
    with torch.inference_mode():
        with (
            parallel_state(GroupCoordinator(), GroupCoordinator(0, 2)),
            set_forward_context(meta, cfg0),
        ):
            mid = first(prompt, positions)
        assert isinstance(mid, IntermediateTensors)
        assert set(mid) == {"hidden_states", "residual"}
        with (
            parallel_state(GroupCoordinator(), GroupCoordinator(1, 2)),
            set_forward_context(meta, cfg1),
        ):
            logits = last.compute_logits(last(None, positions, mid))
    want = hf_logits(hf, [prompt])
    assert torch.allclose(logits, want, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tensor_parallel_slices(tmp_path, kv_heads):
    """Each TP rank holds its slice; with fewer KV heads than ranks, KV is replicated."""
    config = llama_config(num_attention_heads=4, num_key_value_heads=kv_heads)
    hf = save_checkpoint(tmp_path, config)
    full = hf.model.layers[0]
    d = 16
    for rank in range(2):
        with parallel_state(GroupCoordinator(rank, 2), GroupCoordinator()):
            model = build_model(_engine_config(load_hf_config(tmp_path), tmp_path))
            load_weights(model, tmp_path)
        ours = model.model.layers[0]
        q = full.self_attn.q_proj.weight[rank * 2 * d : (rank + 1) * 2 * d]
        kv_index = rank if kv_heads == 2 else 0
        k = full.self_attn.k_proj.weight[kv_index * d : (kv_index + 1) * d]
        v = full.self_attn.v_proj.weight[kv_index * d : (kv_index + 1) * d]
        assert torch.equal(ours.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
        half = config.intermediate_size // 2
        gate = full.mlp.gate_proj.weight[rank * half : (rank + 1) * half]
        up = full.mlp.up_proj.weight[rank * half : (rank + 1) * half]
        assert torch.equal(ours.mlp.gate_up_proj.weight, torch.cat([gate, up]))
        down = full.mlp.down_proj.weight[:, rank * half : (rank + 1) * half]
        assert torch.equal(ours.mlp.down_proj.weight, down)
        vocab_half = config.vocab_size // 2
        assert torch.equal(
            model.model.embed_tokens.weight,
            hf.model.embed_tokens.weight[rank * vocab_half : (rank + 1) * vocab_half],
        )


def test_dense_model_is_deterministic_across_batch_layouts(tmp_path):
    save_checkpoint(tmp_path, llama_config())
    model, cfg = load_ours(tmp_path)
    a, b = torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8])
    together = packed_logits(model, cfg, [a, b])
    alone = torch.cat([packed_logits(model, cfg, [a]), packed_logits(model, cfg, [b])])
    assert torch.allclose(together, alone, atol=1e-5)


def test_forward_context_is_per_thread():
    """Two engines stepping on two threads each read their own step's metadata: a context
    set on one thread is not seen, nor replaced, by another's."""
    import threading
    from types import SimpleNamespace

    from compilecore.forward_context import get_forward_context, set_forward_context

    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    both_set, seen = threading.Barrier(2), {}

    def step(name: str) -> None:
        with set_forward_context(name, config):
            both_set.wait()  # the other thread's context is set now too
            seen[name] = get_forward_context().attn_metadata
            both_set.wait()

    threads = [threading.Thread(target=step, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "a", "b": "b"}
