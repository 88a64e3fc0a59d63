"""Async scheduling (runtime/async_scheduling.py): each step launched before the last
one's tokens reach the host, their ids gathered on the device, stops applied one step
late. The oracle is the same model's engine without it (fp32, so the two agree to the
last bit on any batch): every request's tokens, finish reason and text are the same, and
no KV block is left held."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from compilecore import testing
from runtime import LLM, SamplingParams
from runtime.cpu_sampling import degenerate_row_token
from runtime.request import Request
from runtime.sampler import Sampler
from tests.helpers import all_blocks_free, completions

pytestmark = pytest.mark.slow
ENGINE = {"dtype": "float32", "block_size": 4, "max_model_len": 96}


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    """(async, sync) engines on the tiny model, sharing one compile cache."""
    config = {"cache_dir": str(tmp_path_factory.mktemp("async_cache"))}
    made = [LLM(str(tiny_llama[0]), async_scheduling=on, compilation_config=config, **ENGINE)
            for on in (True, False)]  # fmt: skip
    return tuple(made)


@testing.settings(max_examples=8)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    max_tokens=st.lists(st.integers(1, 20), min_size=6, max_size=6),
    stop_at=st.one_of(st.none(), st.integers(0, 19)),
    seed=st.integers(0, 2**16),
)
def test_async_greedy_equals_sync(engines, lengths, max_tokens, stop_at, seed):
    """Any batch of greedy requests, each with its own `max_tokens` (so they finish on
    different steps, one step late), optionally stopped by a token the sync run emits."""
    fast, oracle = engines
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, n).tolist() for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    want = completions(oracle, prompts, params[: len(prompts)])
    if stop_at is not None:
        stop = want[0][0][min(stop_at, len(want[0][0]) - 1)]
        params = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[stop])
                  for m in max_tokens]  # fmt: skip
        want = completions(oracle, prompts, params[: len(prompts)])
    before = fast.llm_engine.num_fed_steps
    assert completions(fast, prompts, params[: len(prompts)]) == want
    if max(p.max_tokens for p in params[: len(prompts)]) > 1:
        assert fast.llm_engine.num_fed_steps > before  # ids went device to device
    assert all_blocks_free(fast)


def test_stop_strings_and_the_model_length_one_step_late(engines):
    """A stop string (text held back, then cut) and a request that runs into
    max_model_len: the scheduler computes no step past a pending token that ends it."""
    fast, oracle = engines
    prompts = ["The quick brown fox", "Compilers turn programs"]
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = completions(oracle, prompts[:1], free)[0][2]
    stop = text[len(text) // 2 :][:3]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
    assert completions(fast, prompts, params) == completions(oracle, prompts, params)
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    got = completions(fast, prompts, long)
    assert got == completions(oracle, prompts, long)
    assert {reason for _, reason, _ in got} == {"length"}
    assert all_blocks_free(fast)
    # 5 tokens: a prefill and 4 fed decode steps; none after the fifth, whose id is still
    # on the device when the next step is planned.
    before = fast.llm_engine.num_fed_steps
    completions(fast, prompts[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert fast.llm_engine.num_fed_steps - before == 4


def test_sampled_requests_draw_on_the_device_as_the_sync_engine_does(engines):
    """Seeded requests with temperature, top-k, top-p and min-p beside a greedy one: every
    step after the first is fed on the device (none waits for the host), and each request
    gets the sync engine's tokens."""
    fast, oracle = engines
    prompts = [[5, 17, 42], [9, 8, 7, 6], [11, 12], [100, 3]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02, seed=11,
                             max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0.6, top_p=0.5, seed=5, max_tokens=9,
                             ignore_eos=True)]  # fmt: skip
    before = fast.llm_engine.num_fed_steps
    assert completions(fast, prompts, params) == completions(oracle, prompts, params)
    assert fast.llm_engine.num_fed_steps - before == 14  # 15 steps: a prefill, 14 fed
    assert all_blocks_free(fast)


def test_a_request_that_samples_on_the_host_drains_the_pipeline(engines):
    """Greedy and sampled requests with one asking for logprobs: while it lives, steps
    sample on the host (after reading the step in flight); every output equals the sync
    engine's."""
    fast, oracle = engines
    prompts = [[5, 17, 42], [9, 8, 7, 6], [11, 12], [100, 3]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)]  # fmt: skip
    before = fast.llm_engine.num_fed_steps
    assert completions(fast, prompts, params) == completions(oracle, prompts, params)
    # Step 10, the first after it finished, starts the pipeline; steps 11-15 are fed.
    assert fast.llm_engine.num_fed_steps - before == 15 - 10
    assert all_blocks_free(fast)


def test_prefix_cache_hashes_only_known_tokens(engines):
    """A prompt that repeats an earlier request's prompt and output hits the blocks that
    request filled, including those written while their last id was still on the device."""
    fast, oracle = engines
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    first = [7, 8, 9]
    tokens = completions(fast, [first], params)[0][0]
    again = first + tokens[:12] + [4]
    before = fast.llm_engine.scheduler.block_manager.num_free_blocks
    out = fast.generate([again], params, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 12  # 3 full blocks of 4
    assert out.outputs[0].token_ids == completions(oracle, [again], params)[0][0]
    assert fast.llm_engine.scheduler.block_manager.num_free_blocks == before


def test_an_abort_while_a_step_is_in_flight(engines):
    """Aborting a request whose next token is still on the device: it gets no token
    after the abort, its blocks are freed, and the request beside it is unaffected."""
    fast, oracle = engines
    engine = fast.llm_engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [Request(f"abort-{i}", [5 + i, 17, 42], params) for i in range(2)]
    for req in reqs:
        engine.add_request(req)
    engine.step()
    engine.step()  # the second step is launched; the first's tokens are read
    assert reqs[0].num_pending == 1
    kept = list(reqs[0].output_token_ids)
    engine.abort_request(reqs[0].request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # reads what is left in flight
    assert reqs[0].output_token_ids == kept and reqs[0].finish_reason == "abort"
    assert reqs[1].output_token_ids == completions(oracle, [[6, 17, 42]], params)[0][0]
    assert all_blocks_free(fast)


def _rows(params: list[SamplingParams]) -> list[Request]:
    return [Request(f"row-{i}", [1, 2], p) for i, p in enumerate(params)]


def _degenerate_logits() -> torch.Tensor:
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 4] = logits[3, 9] = float("inf")
    return logits


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_device_draws_give_the_host_samplers_degenerate_rows(temperature):
    """A row with a nan, one all -inf and one with two +inf: the device draw gives the
    token the host sampler gives, greedy or sampled."""
    logits = _degenerate_logits()
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(5)]
    got = Sampler()._draw(logits, _rows(params)).tolist()
    if temperature == 0:
        assert got[0] == int(logits[0].argmax()) and got[4] == int(logits[4].argmax())
    assert got[1:4] == [degenerate_row_token(logits[i].numpy()) for i in (1, 2, 3)]


class _HostReads(TorchDispatchMode):
    """The ops that hand a value computed on the device to the host (each waits for the
    device to reach it)."""

    READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
             "equal", "is_nonzero", "item"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        indices = args[1] if name.startswith("index") and len(args) > 1 else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            name = "nonzero"  # a mask index counts its rows on the host
        self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_device_draws_read_nothing_back():
    """Greedy and sampled rows (every filter): the draw calls no op that reads a device
    value on the host, and gives what the sync sampler gives for the same seeds."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0.9, seed=4),
              SamplingParams(temperature=1.2, top_k=30, top_p=0.8, min_p=0.01, seed=5),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, top_p=0.3, seed=6),
              SamplingParams(temperature=2.0, top_k=3, seed=7)]  # fmt: skip
    with _HostReads() as mode:
        got = Sampler()._draw(logits, _rows(params))
    assert mode.names and not _HostReads.READS.intersection(mode.names), mode.names
    want = Sampler()._sample_torch(logits, _rows(params), frozenset()).token_ids
    assert got.tolist() == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tokens_do_not_synchronize_on_a_gpu():
    """On a GPU the draw of sampled rows queues behind the step with no host sync
    (torch's sync debug mode raises on one), with the sync sampler's tokens."""
    logits = torch.randn(4, 5000, device="cuda")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=4),
              SamplingParams(temperature=1.2, top_k=30, top_p=0.8, min_p=0.01, seed=5),
              SamplingParams(temperature=0.5, top_p=0.3, seed=6)]  # fmt: skip
    Sampler().device_tokens(logits, _rows(params))  # first use: generators, pinned pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = Sampler().device_tokens(logits, _rows(params))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = Sampler()._sample_torch(logits, _rows(params), frozenset()).token_ids
    assert got.tolist() == want


def test_async_scheduling_runs_one_process(tiny_llama):
    with pytest.raises(ValueError, match="async_scheduling runs one process"):
        LLM(str(tiny_llama[0]), async_scheduling=True, tensor_parallel_size=2)
