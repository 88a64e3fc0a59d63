"""`compilecore.decode_layer` and the pass that emits it: a decoder layer's one-token piece
as one parallel region of our C loops (`decode_layer.cpp`). Oracles: the unfused math
(`decode_layer_ref`, op by op as the model computes it) on the same bf16 values, and the
pass verifier running each piece before and after the pass."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilecore import cpu_graph, testing
from passes import native
from passes.ops import decode_layer as op

pytestmark = pytest.mark.skipif(not op.kernel_available(), reason="no AVX-512 here")


def _inputs(hidden, inter, heads, kv_heads, head_dim, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    positions = torch.randint(0, 32, (1,), generator=g)
    angles = torch.arange(32.0)[:, None] / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return [
        rand(1, q_size), rand(1, hidden), rand(hidden, q_size, scale=q_size**-0.5),
        1 + rand(hidden, scale=0.1), rand(2 * inter, hidden, scale=hidden**-0.5),
        rand(hidden, inter, scale=inter**-0.5), 1 + rand(hidden, scale=0.1),
        rand(q_size + 2 * kv_size, hidden, scale=hidden**-0.5), positions, cache,
    ]  # fmt: skip


def _close(got, want):
    """bf16 outputs of fp32 sums in another order: a last-bit flip of an intermediate can
    move a value by a few bf16 ulps of the largest value."""
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        scale = w.float().abs().max().item()
        assert (g.float() - w.float()).abs().max().item() <= 0.03 * scale + 1e-3


@testing.settings(max_examples=25)
@given(
    hidden=st.sampled_from([16, 40, 64, 96]), inter=st.sampled_from([8, 24, 48, 80]),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), head_dim=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_op_equals_the_unfused_math(hidden, inter, heads, head_dim, seed):
    """Sizes with tails past each 16 (hidden 40, inter 24 and 8), GQA and MHA, every
    position: q, k, v and the new residual as the model's own ops compute them in bf16."""
    args = _inputs(hidden, inter, *heads, head_dim, seed=seed)
    shape = (1e-5, heads[0], heads[1], head_dim)
    _close(torch.ops.compilecore.decode_layer(*args, *shape), op.decode_layer_ref(*args, *shape))


@testing.settings(max_examples=6)
@given(seed=st.integers(0, 2**16), position=st.integers(0, 31))
def test_unrolled_products_equal_the_unfused_math(seed, position):
    """Rows of 264 and 256 (a real model's ~1 KB rows; 264 leaves a tail past each 16) run
    the build unrolled for those lengths, against the same oracle."""
    args = _inputs(264, 256, 4, 2, 66, seed=seed)
    args[8].fill_(position)
    shape = (1e-5, 4, 2, 66)
    assert op._kernel(native.unrolled_sizes(264, 256)).decode_layer_unrolled(264) == 1
    _close(torch.ops.compilecore.decode_layer(*args, *shape), op.decode_layer_ref(*args, *shape))


def test_prefetching_builds_compute_the_same_bits(monkeypatch):
    """The products' weight prefetch (`native.weight_prefetch_bytes`: 4 KB on Intel CPUs,
    none elsewhere) moves no arithmetic: the unrolled builds with and without it give the
    same q, k, v and residual bit for bit (rows of 528 and 512 bytes, so every product
    prefetches ahead of most of its rows). Both builds are made on any CPU."""
    args = _inputs(264, 256, 4, 2, 66, seed=5)
    shape = (1e-5, 4, 2, 66)
    outs = []
    try:
        for ahead in (0, 4096):
            monkeypatch.setattr(native, "weight_prefetch_bytes", lambda ahead=ahead: ahead)
            op._kernel.cache_clear()
            outs.append(torch.ops.compilecore.decode_layer(*args, *shape))
    finally:
        monkeypatch.undo()
        op._kernel.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    _close(outs[1], op.decode_layer_ref(*args, *shape))


def test_a_wrong_rotation_would_be_caught():
    """The tolerance is far below what a real mistake costs: RoPE at the wrong position."""
    args = _inputs(64, 48, 4, 2, 32)
    want = op.decode_layer_ref(*args, 1e-5, 4, 2, 32)
    args[8] = args[8] + 1
    with pytest.raises(AssertionError):
        _close(torch.ops.compilecore.decode_layer(*args, 1e-5, 4, 2, 32), want)


def test_other_cases_run_the_reference():
    """fp32, or more than one row: the torch reference, exactly."""
    args = _inputs(32, 16, 2, 1, 16, dtype=torch.float32)
    got = torch.ops.compilecore.decode_layer(*args, 1e-5, 2, 1, 16)
    for g, w in zip(got, op.decode_layer_ref(*args, 1e-5, 2, 1, 16)):
        assert torch.equal(g, w)


def test_the_call_is_recorded_into_cpu_graphs(tmp_path):
    """A replay on new input values (the attention output, the residual, the position)
    equals the op called again."""
    args = _inputs(64, 48, 4, 2, 32)
    with torch.inference_mode():

        def run():
            return torch.ops.compilecore.decode_layer(*args, 1e-5, 4, 2, 32)

        out, graph = cpu_graph.capture(run, tmp_path)
        assert graph.num_calls == 1
        _close(out, op.decode_layer_ref(*args, 1e-5, 4, 2, 32))
        args[0].copy_(torch.randn_like(args[0]))
        args[1].copy_(torch.randn_like(args[1]))
        args[8].fill_(7)
        replayed = [t.clone() for t in graph.replay()]
        for r, w in zip(replayed, run()):
            assert torch.equal(r, w)


def test_the_engine_fuses_the_middle_piece_at_batch_1(tiny_llama, tmp_path):
    """A bf16 engine on a 2-layer model: the one middle piece's one-token code holds the op
    (the verifier ran it against the unfused piece on random inputs), the symbolic-size
    code does not; with and without the verifier batch-1 decode replays a CPU graph (the
    verifier's engine loads its kernels outside Inductor's module list: its first capture
    finds them, the next records them), with the same tokens."""
    from runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for verify in (True, False):
        cc = {"cache_dir": str(tmp_path / str(verify)), "passes": {"verify": verify}}
        llm = LLM(str(tiny_llama[0]), dtype="bfloat16", compilation_config=cc)
        tokens.append(llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids)
        if verify:  # the match counts, whether the passes ran or a saved report stood in
            stats = llm.llm_engine.runner.model.model._compiled_forward.backend.stats
            assert stats.pass_matches_by_variant["size_1"]["fuse_decode_layer"] == 1
            assert stats.pass_matches_by_variant["general"].get("fuse_decode_layer", 0) == 0
        assert isinstance(llm.llm_engine.runner.cpu_graphs[1], cpu_graph.CpuGraph)
    graph = llm.llm_engine.runner.cpu_graphs[1]
    assert isinstance(graph, cpu_graph.CpuGraph)
    program = graph.program.tolist()  # the op recorded as a team function for the pool
    at = program.index(native.function_address(op._kernel().decode_layer_team_bf16))
    assert program[at - 1] >> 16 == torch.get_num_threads()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
