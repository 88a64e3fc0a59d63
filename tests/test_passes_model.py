"""All passes on a whole random Llama through the engine: match counts by formula, the
verifier on, and greedy tokens equal to the unfused engine's."""

from __future__ import annotations

from runtime import LLM, SamplingParams

ALL_ON = {"fuse_add_rms_norm": True, "fuse_qkv_rope": True, "verify": True}


def test_whole_model_matches_and_tokens(tiny_llama, tmp_path):
    layers = tiny_llama[1].config.num_hidden_layers
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42, 43], [100 + i for i in range(30)]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fused = LLM(
        str(tiny_llama[0]), compilation_config={"passes": ALL_ON, "cache_dir": str(tmp_path)}
    )
    stats = fused.llm_engine.model.model._compiled_forward.backend.stats
    # add+RMSNorm: every post-attention norm, the input norms of layers 1.., the final norm.
    assert stats.pass_matches["fuse_add_rms_norm"] == 2 * layers
    assert stats.pass_matches["fuse_qkv_rope"] == layers  # one per attention layer
    plain = LLM(str(tiny_llama[0]), compilation_config={"cache_dir": str(tmp_path)})
    plain_stats = plain.llm_engine.model.model._compiled_forward.backend.stats
    # fp32: by default the fusions fire on CPU only for their C kernels' dtype (bf16)
    assert plain_stats.pass_matches.get("fuse_add_rms_norm", 0) == 0
    got = [o.outputs[0].token_ids for o in fused.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
