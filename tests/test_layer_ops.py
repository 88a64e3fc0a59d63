"""The batch-1 layer ops and the passes that emit them: `compilecore.linear` (mm and addmm),
`fused_add_rms_norm`, `silu_and_mul` and `fused_qkv_rope`, each with a C kernel
(`layer_kernels.cpp`) that a CPU graph records as a team function, so a piece's ops and the
attention between pieces replay as one parallel region. Oracles: each op's torch reference
on the same bf16 values, eager for the engine's tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from transformers import MistralConfig, Qwen2Config

from compilecore import cpu_graph, testing
from passes.ops import add_rms_norm, layer_kernels, qkv_rope, silu_and_mul
from tests.helpers import TOKENIZER_VOCAB, save_checkpoint

pytestmark = pytest.mark.skipif(not layer_kernels.available(), reason="no AVX-512 or g++")

BF16 = torch.bfloat16


def _rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def _cache(positions: int, rotary_dim: int) -> torch.Tensor:
    angles = torch.arange(float(positions))[:, None] / 10000 ** (
        torch.arange(0, rotary_dim, 2) / rotary_dim
    )
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 2) -> None:
    """bf16 results of fp32 sums taken in another order: a few bf16 ulps of the largest."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= ulps * 2**-7 * scale + 1e-6


@testing.settings(max_examples=25)
@given(
    rows=st.integers(1, 5), hidden=st.sampled_from([8, 40, 64, 200]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_norm_and_silu_kernels_equal_their_references(rows, hidden, seed):
    """Bit for bit: each rounds where the unfused graph rounds (one row split by columns,
    more rows by rows; lengths with tails past each 16)."""
    g = torch.Generator().manual_seed(seed)
    x, res, w = _rand(g, rows, hidden), _rand(g, rows, hidden), 1 + _rand(g, hidden, scale=0.1)
    got = torch.ops.compilecore.fused_add_rms_norm(x, res, w, 1e-5)
    want = add_rms_norm.fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    gu = _rand(g, rows, 2 * hidden, scale=4.0)
    assert torch.equal(torch.ops.compilecore.silu_and_mul(gu), silu_and_mul.silu_and_mul_ref(gu))


@testing.settings(max_examples=25)
@given(
    rows=st.integers(1, 4), heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    head_dim=st.sampled_from([16, 32, 64]), partial=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_rope_kernel_equals_its_reference(rows, heads, head_dim, partial, seed):
    """GQA and MHA, whole-head and partial rotation, any positions, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    h, kv = heads
    qkv = _rand(g, rows, (h + 2 * kv) * head_dim)
    positions = torch.randint(0, 64, (rows,), generator=g)
    cache = _cache(64, head_dim // 2 if partial else head_dim)
    got = torch.ops.compilecore.fused_qkv_rope(qkv, positions, cache, h, kv, head_dim)
    want = qkv_rope.fused_qkv_rope_ref(qkv, positions, cache, h, kv, head_dim)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@testing.settings(max_examples=25)
@given(
    k=st.sampled_from([16, 40, 576, 1000]), n=st.sampled_from([1, 7, 64, 300]),
    bias=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_linear_kernel_equals_f_linear(k, n, bias, seed):
    """One row, with and without a bias (added in fp32 and rounded once, as addmm does);
    row lengths with an unrolled loop (576) and without."""
    g = torch.Generator().manual_seed(seed)
    x, w = _rand(g, 1, k), _rand(g, n, k, scale=k**-0.5)
    b = _rand(g, n) if bias else None
    _within_ulps(torch.ops.compilecore.linear(x, w, b), F.linear(x, w, b), ulps=1)


def test_linear_takes_its_reference_outside_the_kernel_cases():
    """More rows, fp32, a transposed weight: F.linear's own result."""
    g = torch.Generator().manual_seed(0)
    x, w = _rand(g, 3, 32), _rand(g, 16, 32)
    assert torch.equal(torch.ops.compilecore.linear(x, w), F.linear(x, w))
    xf, wf = x.float(), w.float()
    assert torch.equal(torch.ops.compilecore.linear(xf, wf), F.linear(xf, wf))
    wt = _rand(g, 32, 16).t()
    assert torch.equal(torch.ops.compilecore.linear(x[:1], wt), F.linear(x[:1], wt))


def test_a_chain_of_ops_replays_as_one_team_region(tmp_path):
    """A layer's ops captured from their declared C entry points (the ops record nothing
    themselves): one team run, and a replay on new inputs equals running the ops again."""
    g = torch.Generator().manual_seed(1)
    hidden, inter, (h, kv, d) = 64, 96, (4, 2, 16)
    attn, res = _rand(g, 1, h * d), _rand(g, 1, hidden)
    w_o, w_gu = _rand(g, hidden, h * d, scale=0.1), _rand(g, 2 * inter, hidden, scale=0.1)
    w_down = _rand(g, hidden, inter, scale=0.1)
    w_qkv = _rand(g, (h + 2 * kv) * d, hidden, scale=0.1)
    norm = 1 + _rand(g, hidden, scale=0.1)
    positions, cache = torch.tensor([5]), _cache(16, d)
    ops = torch.ops.compilecore

    def layer():
        x, s = ops.fused_add_rms_norm(ops.linear(attn, w_o), res, norm, 1e-5)
        m = ops.silu_and_mul(ops.linear(x, w_gu))
        x, s = ops.fused_add_rms_norm(ops.linear(m, w_down), s, norm, 1e-5)
        return (*ops.fused_qkv_rope(ops.linear(x, w_qkv), positions, cache, h, kv, d), s)

    out, graph = cpu_graph.capture(layer, tmp_path)
    assert graph.num_calls == 8
    # every call a team call: one region, a barrier after each call but the last
    region = graph.regions[0]
    assert len(graph.regions) == 1 and region.team == torch.get_num_threads()
    assert region.barriers == (True,) * 7 + (False,)
    attn.copy_(_rand(g, 1, h * d))
    positions.fill_(11)
    replayed = [t.clone() for t in graph.replay()]
    for r, w in zip(replayed, layer()):
        assert torch.equal(r, w)


def test_a_reference_run_is_refused_by_the_capture(tmp_path):
    """An op that ran its torch reference (fp32 here) cannot be replayed: the capture says
    which op."""
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="compilecore.linear"):
        cpu_graph.capture(lambda: torch.ops.compilecore.linear(x, w), tmp_path)


def _general(stats):
    return stats.pass_matches_by_variant["general"]


def test_the_engine_builds_batch_1_from_the_small_passes(tiny_llama, tmp_path):
    """A bf16 engine on a 2-layer model: the mission's fusions match 2L / L / L times in the
    size-1 code and in the symbolic code, every product of the size-1 code is
    `compilecore.linear` (the verifier ran each pass on random inputs), batch-1 decode
    replays one CPU graph whose layer ops are team calls, and the tokens are eager's."""
    from runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cc = {"cache_dir": str(tmp_path), "passes": {"verify": True}}
    llm = LLM(str(tiny_llama[0]), dtype="bfloat16", compilation_config=cc)
    got = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.llm_engine.runner.model.model._compiled_forward.backend.stats
    layers = 2
    for variant in ("size_1", "general"):
        counts = stats.pass_matches_by_variant[variant]
        assert counts["fuse_add_rms_norm"] == 2 * layers
        assert counts["fuse_qkv_rope"] == layers and counts["fuse_silu_and_mul"] == layers
    assert stats.pass_matches_by_variant["size_1"]["native_linear"] == 4 * layers
    assert _general(stats).get("native_linear", 0) == 0
    graph = llm.llm_engine.runner.cpu_graphs[1]
    assert isinstance(graph, cpu_graph.CpuGraph)
    norms = [i for i, info in enumerate(graph.described)
             if info.source.startswith("compilecore::fused_add_rms_norm")]  # fmt: skip
    teams = {r.team for r in graph.regions for c in r.calls if c in norms}
    assert norms and teams == {torch.get_num_threads()}
    eager = LLM(str(tiny_llama[0]), dtype="bfloat16", compilation_config={"mode": "none"})
    want = eager.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and len(got) == 8


def test_native_kernels_off_leaves_inductor_alone(tiny_llama, tmp_path):
    """`native_kernels=False`: no pass emits an op with our C kernel, batch-1 products are
    Inductor's reduction loops; the same tokens (the verifier makes the passes run even
    where Inductor's cache holds the pieces, so the counts are this compile's)."""
    from runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cc = {"cache_dir": str(tmp_path), "native_kernels": False, "passes": {"verify": True}}
    llm = LLM(str(tiny_llama[0]), dtype="bfloat16", compilation_config=cc)
    got = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.llm_engine.runner.model.model._compiled_forward.backend.stats
    for counts in stats.pass_matches_by_variant.values():
        for name in ("native_linear", "fuse_add_rms_norm", "packed_linear", "fuse_qkv_rope"):
            assert counts.get(name, 0) == 0
    assert stats.pass_matches_by_variant["size_1"]["gemv_to_reduction"] == 8
    eager = LLM(str(tiny_llama[0]), dtype="bfloat16", compilation_config={"mode": "none"})
    want = eager.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


_SHAPES = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(num_key_value_heads=2, architectures=["Qwen2ForCausalLM"], **_SHAPES),
        MistralConfig(num_key_value_heads=1, sliding_window=None,
                      architectures=["MistralForCausalLM"], **_SHAPES),
    ],
    ids=["qwen2", "mistral"],
)  # fmt: skip
def test_other_architectures_record_cpu_graphs(config, tokenizer_dir, tmp_path):
    """Qwen2 (q/k/v bias: `addmm`) and Mistral: CPU graphs at batch 1 and at a batch of 3,
    tokens equal to eager's."""
    from runtime import LLM, SamplingParams

    save_checkpoint(tmp_path / "m", config, dtype=BF16, tokenizer_dir=tokenizer_dir)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["hello world", "a b c", "the end"]
    outs = {}
    for mode in ("piecewise", "none"):
        cc = {"mode": mode, "cache_dir": str(tmp_path / "cache")}
        llm = LLM(str(tmp_path / "m"), dtype="bfloat16", compilation_config=cc)
        one = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        three = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        outs[mode] = (one, three)
        if mode == "piecewise":
            graphs = llm.llm_engine.runner.cpu_graphs
            assert isinstance(graphs.get(1), cpu_graph.CpuGraph), graphs
            assert isinstance(graphs.get(3), cpu_graph.CpuGraph), graphs
    assert outs["piecewise"] == outs["none"]
