"""The Triton paged-attention kernels: under TRITON_INTERPRET=1 on CPU (small drawn
shapes) against the torch backend and dense attention; on CUDA for real (GPU-marked)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import LLM, SamplingParams
from runtime.attention import TorchPagedAttentionBackend
from runtime.attention.torch_paged import ROWS_AS_DECODES
from runtime.attention.triton_paged import (
    SPLIT_VARIANTS,
    TritonPagedAttentionBackend,
    choose_num_splits,
    interpreter_problem,
    pages_per_trip,
    split_variant,
)
from tests.attention_cases import (
    Batch,
    batches,
    build_case,
    check_rows_as_decodes,
    invariant_batches,
    run_and_check,
)

_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not _INTERPRETER or interpreter_problem() is not None,
    reason=(interpreter_problem() if _INTERPRETER else None)
    or "needs TRITON_INTERPRET=1 (set without CUDA)",
)
SMALL = dict(
    head_sizes=(64, 80, 96, 128),
    block_sizes=(16, 32),
    max_ctx=40,
    max_q=5,
    max_seqs=2,
    dtypes=(torch.float32, torch.bfloat16),
)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@interpreted
@settings(max_examples=12, deadline=None)
@given(batch=batches(**SMALL), splits=st.sampled_from([1, 2]))
def test_triton_equals_torch_and_dense(batch, splits):
    case = build_case(batch)
    got = run_and_check(case, TritonPagedAttentionBackend(num_splits=splits), TOL[batch.dtype])
    again = build_case(batch)  # fresh cache: the torch backend writes it too
    want = run_and_check(again, TorchPagedAttentionBackend(), TOL[batch.dtype])
    n = case.meta.num_actual_tokens
    scale = max(1.0, want[:n].float().abs().max().item())
    assert (got[:n].float() - want[:n].float()).abs().max().item() <= TOL[batch.dtype] * scale


@pytest.mark.filterwarnings("error::RuntimeWarning")
@interpreted
@settings(max_examples=8, deadline=None)
@given(
    batch=batches(
        head_sizes=(16, 64, 80),
        block_sizes=(16, 32),
        max_ctx=40,
        max_q=40,
        max_seqs=3,
        dtypes=(torch.float32, torch.bfloat16),
    )
)
def test_prefill_tiles_equal_per_token_kernel(batch):
    """Query tiles (tl.dot) against the per-token kernel and dense attention, with prompts
    long enough to span several tiles and ragged last tiles. No 0/0 anywhere either (the
    interpreter warns on it): a tile past a prompt's end must not divide by its empty sum."""
    tiled = run_and_check(build_case(batch), TritonPagedAttentionBackend(), TOL[batch.dtype])
    plain = run_and_check(
        build_case(batch), TritonPagedAttentionBackend(prefill_tiles=False), TOL[batch.dtype]
    )
    n = batch_tokens(batch)
    scale = max(1.0, plain[:n].float().abs().max().item())
    assert (tiled[:n].float() - plain[:n].float()).abs().max().item() <= TOL[batch.dtype] * scale


def batch_tokens(batch: Batch) -> int:
    return sum(q for _, q in batch.seqs)


@interpreted
def test_prefill_tiles_with_stale_nan_slots():
    """Pages past a sequence's end may hold NaN from earlier requests; masked scores must
    not turn them into NaN outputs through P @ V."""
    batch = Batch(
        block_size=16, kv_heads=2, heads=6, head_size=64, seqs=[(3, 20), (0, 17)], padding=2, seed=1
    )
    case = build_case(batch)
    cache = case.layer.kv_cache
    table = case.meta.block_table
    for i, length in enumerate(case.meta.seq_lens_cpu):
        last = table[i, (length - 1) // 16].item()
        cache[:, last, length % 16 or 16 :] = float("nan")
    case.cache_before = cache.clone()
    out = run_and_check(case, TritonPagedAttentionBackend(), 1e-4)
    assert not out[: case.meta.num_actual_tokens].isnan().any()


@interpreted
def test_split_kv_long_context():
    batch = Batch(
        block_size=16, kv_heads=1, heads=2, head_size=64, seqs=[(150, 1)], padding=1, seed=3
    )
    run_and_check(build_case(batch), TritonPagedAttentionBackend(num_splits=4), 1e-4)


@interpreted
@settings(max_examples=6, deadline=None)
@given(
    contexts=st.lists(st.integers(0, 300), min_size=1, max_size=3),
    block=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_decode_launch_sized_for_the_longest_context(contexts, block, seed):
    """A full decode graph captures attention with the model's longest context, so the
    launch's split count is fixed whatever the lengths at replay: each sequence spreads
    its own blocks over the splits (at least SPLIT_MIN_TOKENS a split, so a short one
    uses one and leaves the rest empty, which the merge skips), equal to dense attention."""
    seqs = [(c, 1) for c in contexts]
    batch = Batch(block_size=block, kv_heads=2, heads=4, head_size=64, seqs=seqs, padding=0,
                  seed=seed)  # fmt: skip
    case = build_case(batch)
    case.meta.max_seq_len = 4096  # as FullCudaGraph's capture sets it (max_model_len)
    assert choose_num_splits(len(seqs), 2, 4096, block) > 1
    run_and_check(case, TritonPagedAttentionBackend(), 1e-4)


@interpreted
@settings(max_examples=10, deadline=None)
@given(
    contexts=st.lists(st.integers(0, 300), min_size=1, max_size=2),
    block=st.sampled_from([16, 32]),
    trip=st.sampled_from([16, 32, 64, 128]),
    splits=st.integers(1, 5),
    ratio=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_decode_trips_of_several_pages(contexts, block, trip, splits, ratio, seed):
    """A decode loop trip reads `trip` keys of whole pages, and a split holds whole trips
    (a trip across a split's end would count the next split's keys twice: that mutation
    fails here); the last trip past the sequence's end reads none of its stale NaN.
    Any split count and group size, equal to dense attention."""
    seqs = [(c, 1) for c in contexts]
    batch = Batch(block_size=block, kv_heads=2, heads=2 * ratio, head_size=64, seqs=seqs,
                  padding=1, seed=seed)  # fmt: skip
    case = build_case(batch)
    cache = case.layer.kv_cache
    for i, length in enumerate(case.meta.seq_lens_cpu):  # stale NaN after each sequence
        last = case.meta.block_table[i, (length - 1) // block].item()
        cache[:, last, length % block or block :] = float("nan")
    case.cache_before = cache.clone()
    backend = TritonPagedAttentionBackend(num_splits=splits, trip_tokens=trip)
    assert pages_per_trip(block, trip) * block == max(trip, block)
    run_and_check(case, backend, 1e-4)


def test_split_heuristic():
    assert choose_num_splits(1, 8, 8192, 16) > 1  # one decode over a long context: split
    assert choose_num_splits(256, 8, 8192, 16) == 1  # enough programs already
    assert choose_num_splits(1, 8, 256, 16) == 1  # short context


@interpreted
def test_engine_greedy_triton_equals_torch(tiny_llama):
    prompts = [[5, 6, 7, 8, 9], [42], [100 + i for i in range(20)]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama[0]), enforce_eager=True, attention_backend=backend)
        outs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outs["triton"] == outs["torch"]


@interpreted
def test_engine_with_forced_split_kv_equals_torch(tiny_llama):
    """`attention_num_splits=4` reaches the backend, and a decode over a 70-token context
    (5 blocks of 16, so the splits are real) through the split and merge kernels gives
    torch's greedy tokens."""
    prompt = [3 + (i * 7) % 90 for i in range(70)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend, splits in (("torch", None), ("triton", 4)):
        llm = LLM(str(tiny_llama[0]), enforce_eager=True, attention_backend=backend,
                  attention_num_splits=splits)  # fmt: skip
        if splits:
            assert llm.llm_engine.runner.attn_backend.num_splits == splits
        outs[backend] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert outs["triton"] == outs["torch"]


def test_forcing_triton_without_a_gpu_or_interpreter_is_a_clear_error(monkeypatch):
    from runtime.worker import select_attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_attention_backend(torch.device("cpu"), "triton")
    assert select_attention_backend(torch.device("cpu"), "torch").name == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size, block_size", [(64, 16), (80, 16), (96, 32), (128, 32)])
def test_triton_on_cuda_real_sizes(dtype, head_size, block_size):
    seqs = [(500, 1)] * 8 + [(300, 64), (0, 200)]
    batch = Batch(
        block_size=block_size,
        kv_heads=8,
        heads=32,
        head_size=head_size,
        seqs=seqs,
        padding=3,
        seed=0,
        dtype=dtype,
    )
    case = build_case(batch)
    case.layer.kv_cache = case.layer.kv_cache.cuda()
    case.cache_before = case.cache_before.cuda()
    for name in ("q", "k", "v"):
        setattr(case, name, getattr(case, name).cuda())
    meta = case.meta
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_table"):
        setattr(meta, name, getattr(meta, name).cuda())
    out = torch.empty_like(case.q)
    TritonPagedAttentionBackend().forward(case.layer, case.q, case.k, case.v, out, meta)
    ref_layer = type(case.layer)(32, 8, head_size, case.cache_before.clone())
    ref = torch.empty_like(case.q)
    TorchPagedAttentionBackend().forward(ref_layer, case.q, case.k, case.v, ref, meta)
    n = meta.num_actual_tokens
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}[dtype]
    assert (out[:n].float() - ref[:n].float()).abs().max().item() <= tol * ref[
        :n
    ].float().abs().max().item() + tol
    assert torch.equal(case.layer.kv_cache, ref_layer.kv_cache)


def test_step_varying_integers_are_not_specialized():
    """A batch of 1 or of 16 sequences, 1 or 16 splits, a chunk from the first sequence:
    Triton would compile a variant for each (mid-serving, after the capture)."""
    pytest.importorskip("triton")
    from runtime.attention import triton_kernels as k

    wanted = {
        k.attention_kernel: {"num_seqs"},
        k.merge_kernel: {"num_splits"},
        k.prefill_attention_kernel: {"first_seq"},
    }
    for kernel, names in wanted.items():
        if hasattr(kernel, "params"):  # compiled: the JIT's own parameter records
            free = {p.name for p in kernel.params if p.do_not_specialize}
        else:  # interpreted: what the decorator was given
            free = set(kernel.kwargs.get("do_not_specialize") or ())
        assert names <= free, (kernel, free)


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 512), kv_heads=st.sampled_from([1, 2, 4, 8, 32]),
       context=st.integers(1, 1 << 17), block=st.sampled_from([16, 32, 64]))  # fmt: skip
def test_every_split_a_step_chooses_is_a_warmed_variant(tokens, kv_heads, context, block):
    """The start-up warm-up compiles SPLIT_VARIANTS; whatever a step's batch and context,
    the split it chooses runs one of them (no compile mid-serving)."""
    splits = choose_num_splits(tokens, kv_heads, context, block)
    assert split_variant(splits) in SPLIT_VARIANTS
    assert split_variant(splits) >= splits and (splits == 1) == (split_variant(splits) == 1)


@interpreted
def test_the_engine_warms_every_split_variant_once_per_shape(tiny_llama, monkeypatch):
    """Each distinct attention shape is warmed once when the KV cache is made (all
    layers of the tiny model share one), through the real kernels, writing nothing."""
    calls = []
    real = TritonPagedAttentionBackend.warm_up

    def counted(self, layer, kv_cache):
        calls.append(layer)
        before = kv_cache.clone()
        launches = real(self, layer, kv_cache)
        assert torch.equal(kv_cache, before) and launches == len(SPLIT_VARIANTS)
        return launches

    monkeypatch.setattr(TritonPagedAttentionBackend, "warm_up", counted)
    llm = LLM(str(tiny_llama[0]), enforce_eager=True, attention_backend="triton",
              kv_cache_memory=8 << 20)  # fmt: skip
    assert len(calls) == 1
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@interpreted
@settings(max_examples=8, deadline=None)
@given(batch=invariant_batches(max_ctx=80, max_seqs=3))
def test_invariant_rows_are_their_decodes_alone(batch):
    """Batch-invariant mode (one split for every decode; short queries' rows through the
    per-token kernel, the tiles for the longer ones): each decode and each row of a query
    of at most ROWS_AS_DECODES tokens gets the bits of the decode at its position alone;
    the batch is still dense attention."""
    case = build_case(batch)
    backend = TritonPagedAttentionBackend(invariant=True)
    out = run_and_check(case, backend, TOL[batch.dtype])
    check_rows_as_decodes(case, out, backend, ROWS_AS_DECODES)


@interpreted
def test_invariant_mode_on_triton_attention_keeps_each_requests_tokens(tiny_llama):
    """The engine in batch-invariant mode on the Triton backend (the interpreter here):
    greedy requests of several lengths, alone and together, give the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    llm = LLM(str(tiny_llama[0]), attention_backend="triton", max_num_batched_tokens=40,
              max_num_seqs=4, compilation_config={"batch_invariant": True})  # fmt: skip
    assert llm.llm_engine.runner.attn_backend.rows_as_decodes == ROWS_AS_DECODES
    prompts = [[5, 6, 7], [3 + (i * 7) % 90 for i in range(36)], [42]]

    def result(out):
        logprobs = [sorted((t, p.logprob) for t, p in s.items()) for s in out.outputs[0].logprobs]
        return out.outputs[0].token_ids, logprobs

    alone = [result(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    together = [result(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
