"""CUDA graphs per padded batch size (GPU only; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from compilecore.counters import compilation_counter
from runtime import LLM, SamplingParams

gpu = pytest.mark.gpu
SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def graphed(tiny_llama, tmp_path_factory):
    before = compilation_counter.num_cudagraph_captured
    llm = LLM(
        str(tiny_llama[0]),
        device="cuda",
        dtype="float32",
        compilation_config={
            "cudagraph_capture_sizes": SIZES,
            "cache_dir": str(tmp_path_factory.mktemp("cg_cache")),
        },
    )
    return llm, compilation_counter.num_cudagraph_captured - before


@gpu
def test_captured_graphs_per_size_and_piece(graphed, tiny_llama):
    llm, captured = graphed
    layers = tiny_llama[1].config.num_hidden_layers
    assert captured == len(SIZES) * (layers + 1)
    # The default mode (FULL_AND_PIECEWISE) captures each decode size whole as well.
    assert sorted(llm.llm_engine.runner.full_graphs) == SIZES


@gpu
def test_replay_equals_eager_across_padded_sizes(graphed, tiny_llama):
    llm, _ = graphed
    # A second engine on the device: an explicit budget (the first holds its share).
    eager = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", enforce_eager=True,
                kv_cache_memory=256 * 2**20)  # fmt: skip
    # 3 sequences decode as 3 tokens (padded to 4); 5 as 5 (padded to 8); prefill above 16.
    prompts = [[3 + i, 7, 11 + i] for i in range(5)] + [list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for batch in (prompts[:3], prompts[:5], prompts):
        before = compilation_counter.num_full_cudagraph_replays
        with compilation_counter.expect(num_cudagraph_captured=0, num_full_cudagraph_captured=0):
            got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
        assert got == want
        # Each batch decodes 11 steps after its prefill; those replay whole-step graphs.
        assert compilation_counter.num_full_cudagraph_replays - before >= 11


@gpu
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_DECODE_ONLY"])
def test_each_cudagraph_mode_equals_eager(tiny_llama, mode):
    """Piecewise graphs alone, and full decode graphs with mixed steps run piece by piece
    without graphs, against eager; a long prompt in chunks mixes decodes and prefills."""
    budget = dict(kv_cache_memory=128 * 2**20, max_num_batched_tokens=32)
    llm = LLM(
        str(tiny_llama[0]),
        device="cuda",
        dtype="float32",
        **budget,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4], "cudagraph_mode": mode},
    )
    eager = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", enforce_eager=True, **budget)
    prompts = [[3, 7, 11], [5, 9], list(range(20, 90))]  # the last one in chunks of 32
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runner = llm.llm_engine.runner
    full = compilation_counter.num_full_cudagraph_replays
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
    replayed = compilation_counter.num_full_cudagraph_replays - full
    if mode == "PIECEWISE":
        assert runner.full_graphs == {} and replayed == 0
    else:
        assert runner.capture_sizes == [] and sorted(runner.full_graphs) == [1, 2, 4]
        assert replayed > 0


@gpu
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_decode_steps_take_their_tokens_from_the_graph(graphed, tiny_llama, kind):
    """A decode step whose requests all sample plainly draws its tokens in its full graph
    (runtime/sample_kernel.py), greedy or by temperature / top-k / top-p / min-p with a
    seed, in sync and async engines: the same tokens as an eager engine, whose sampler
    launches the same kernel after the step. A step with logprobs reads none from it."""
    llm, _ = graphed
    eager = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", enforce_eager=True,
                kv_cache_memory=256 * 2**20)  # fmt: skip
    piped = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", async_scheduling=True,
                compilation_config={"cudagraph_capture_sizes": SIZES},
                kv_cache_memory=256 * 2**20)  # fmt: skip
    prompts = [[3 + i, 7, 11 + i] for i in range(5)]
    if kind == "greedy":
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 5
    else:
        params = [SamplingParams(temperature=0.9, top_k=[0, 20][i % 2], top_p=[1.0, 0.8][i % 2],
                                 min_p=0.02 * (i % 3), seed=i, max_tokens=12, ignore_eos=True)
                  for i in range(5)]  # fmt: skip
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    for engine in (llm, piped):
        before = compilation_counter.num_full_cudagraph_replays
        got = engine.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        assert compilation_counter.num_full_cudagraph_replays - before >= 11
        assert engine.llm_engine.runner.graph_tokens is not None  # the last step's
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        logprobs = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                  logprobs=1)  # fmt: skip
        engine.generate(prompts[:2], [short, logprobs], use_tqdm=False)  # to the end
        assert engine.llm_engine.runner.graph_tokens is None


@gpu
def test_no_sampled_step_compiles_the_sampling_kernel(graphed, tiny_llama):
    """The sampling kernel is compiled before serving for the graphs' logits and the host
    sampler's fp32 copies: steps with logprobs, a prefill and sampled decodes add none."""
    from runtime.sample_kernel import _sample_kernel

    llm, _ = graphed
    device = torch.cuda.current_device()
    before = len(_sample_kernel.device_caches[device][0])
    params = [SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=6, logprobs=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=6)]  # fmt: skip
    llm.generate([[3, 7, 11], [5, 9]], params, use_tqdm=False)
    assert len(_sample_kernel.device_caches[device][0]) == before


@gpu
def test_full_graphs_stop_at_max_num_seqs(tiny_llama, tmp_path):
    """A decode-only step has a token a sequence: capture sizes beyond max_num_seqs get
    no full graph (their metadata would not fit) and those steps stay piecewise."""
    llm = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", max_num_seqs=4,
              kv_cache_memory=256 * 2**20,
              compilation_config={"cudagraph_capture_sizes": SIZES,
                                  "cache_dir": str(tmp_path)})  # fmt: skip
    assert sorted(llm.llm_engine.runner.full_graphs) == [1, 2, 4]
    eager = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", enforce_eager=True,
                kv_cache_memory=256 * 2**20)  # fmt: skip
    prompts = [[3 + i, 7, 11 + i] for i in range(6)]  # more than max_num_seqs
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


@gpu
def test_padded_size_rounds_up(graphed):
    runner = graphed[0].llm_engine.runner
    assert [runner.padded_size(n) for n in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, 17]
    assert torch.cuda.is_available()


@gpu
def test_kv_cache_sized_after_profiling_and_capture(graphed):
    """The cache is allocated after the profiling forward and the capture, and what the
    process holds then stays within the utilisation share: the largest step still fits."""
    llm, _ = graphed
    engine = llm.llm_engine
    worker = engine.executor.worker
    assert worker.activation_peak > 0
    total = torch.cuda.mem_get_info()[1]
    share = engine.config.cache_config.gpu_memory_utilization * total
    kv = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
    assert worker.own_use > 0 and kv > 0
    assert worker.own_use + kv + worker.activation_peak <= share * 1.02
    # One step over the whole token budget (as far as the model's length allows).
    budget = engine.config.scheduler_config.max_num_batched_tokens
    longest = min(budget, engine.config.model_config.max_model_len - 2)
    prompt = [5 + i % 90 for i in range(longest)]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_kv_budget_is_the_share_less_own_use_and_the_activation_peak():
    """vLLM's accounting: utilization x total, less this engine's own weights and graphs and
    its largest step's activations; never more than is free (a second engine on the device
    gets what the first left, not the first's budget again)."""
    from runtime.worker import kv_budget_after_profiling

    gib = 2**30
    assert kv_budget_after_profiling(80 * gib, 0.5, 6 * gib, 2 * gib, 70 * gib) == 32 * gib
    # Another engine already holds 60 GiB: 10 GiB free, 2 for the activations.
    assert kv_budget_after_profiling(80 * gib, 0.9, 6 * gib, 2 * gib, 10 * gib) == 8 * gib
    # Whatever the device's free memory, another process's use is not this engine's.
    assert kv_budget_after_profiling(80 * gib, 0.5, 1 * gib, 0, 80 * gib) == 39 * gib


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_the_second_device_runs_there(tiny_llama):
    """`device="cuda:1"` while cuda:0 is current: weights, KV cache and graphs on cuda:1
    (Triton launches and captures follow the current device, which the executor enters
    for each call), the same tokens as on cuda:0, and the caller's current device kept."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 7, 11], [5, 9]]
    tokens = {}
    for device in ("cuda:0", "cuda:1"):
        torch.cuda.set_device(0)
        llm = LLM(str(tiny_llama[0]), device=device, dtype="float32",
                  kv_cache_memory=64 << 20, compilation_config={"cudagraph_capture_sizes": [1, 2]})
        runner = llm.llm_engine.runner
        assert {c.device for c in runner.kv_caches} == {torch.device(device)}
        tokens[device] = [o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        assert torch.cuda.current_device() == 0
    assert tokens["cuda:1"] == tokens["cuda:0"]


@gpu
def test_each_engine_captures_into_its_own_pool(graphed, tiny_llama):
    """Graph outputs are held weakly in their pool: a second engine in the process gets a
    pool of its own, so its replays cannot reuse the memory of the first's logits."""
    llm, _ = graphed
    other = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", kv_cache_memory=64 << 20,
                compilation_config={"cudagraph_capture_sizes": [1, 2]})  # fmt: skip
    pools = [e.engine_config.compilation_config.graph_pool for e in (llm, other)]
    assert None not in pools and pools[0] != pools[1]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in other.generate([[3, 7, 11]], params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in llm.generate([[3, 7, 11]], params,
                                                                use_tqdm=False)]  # fmt: skip
