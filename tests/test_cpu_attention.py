"""The C++ CPU attention backend against the torch backend and dense attention, on shapes
drawn by hypothesis, and through the whole engine."""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import models.layers.attention  # noqa: F401 - registers the attention op
from compilecore import cpu_graph
from compilecore.forward_context import set_forward_context
from passes import native
from runtime import LLM, SamplingParams
from runtime.attention import TorchPagedAttentionBackend
from runtime.attention.cpu_build import (
    build_cpu_kernels,
    build_prefill_kernel,
    load_cpu_kernels,
    load_prefill_kernel,
)
from runtime.attention.cpu_paged import (
    PARALLEL_MIN_WORK,
    ROWS_AS_DECODES,
    CpuPagedAttentionBackend,
)
from tests.attention_cases import (
    Batch,
    as_decode_alone,
    batches,
    build_case,
    check_case,
    check_rows_as_decodes,
    invariant_batches,
    run_and_check,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SHAPES = dict(
    head_sizes=(8, 64, 80, 128),
    block_sizes=(1, 4, 16, 32),
    max_ctx=70,
    max_q=6,
    max_seqs=4,
    dtypes=(torch.float32, torch.bfloat16),
)


@pytest.fixture(scope="module")
def backend():
    return CpuPagedAttentionBackend()


@settings(max_examples=60, deadline=None)
@given(batch=batches(**SHAPES))
def test_cpu_equals_torch_and_dense(backend, batch):
    got = run_and_check(build_case(batch), backend, TOL[batch.dtype])
    case = build_case(batch)  # a fresh cache: the torch backend writes it too
    want = run_and_check(case, TorchPagedAttentionBackend(), TOL[batch.dtype])
    n = case.meta.num_actual_tokens
    scale = max(1.0, want[:n].float().abs().max().item())
    assert (got[:n].float() - want[:n].float()).abs().max().item() <= TOL[batch.dtype] * scale


@pytest.mark.parametrize("threads", [1, 2])
def test_many_decodes_long_context(threads):
    """Enough work to use the thread pool; MQA and a large query group."""
    seqs = [(300 + 37 * i, 1) for i in range(12)]
    for kv_heads, heads in ((1, 16), (4, 8)):
        batch = Batch(block_size=16, kv_heads=kv_heads, heads=heads, head_size=64, seqs=seqs,
                      padding=2, seed=kv_heads, dtype=torch.bfloat16)  # fmt: skip
        run_and_check(build_case(batch), CpuPagedAttentionBackend(num_threads=threads), 2e-2)


@st.composite
def split_batches(draw):
    """Batch-1-like decodes: one or two sequences, few KV heads, long contexts (the second
    sequence may be far shorter, leaving parts of it empty)."""
    kv_heads = draw(st.integers(1, 3))
    first = draw(st.integers(PARALLEL_MIN_WORK // kv_heads, 400))  # enough work for 2 threads
    seqs = [(first, 1)]
    if kv_heads == 1 and draw(st.booleans()):
        seqs.append((draw(st.integers(0, 400)), 1))
    return _decode_batch(draw, kv_heads, seqs)


def _decode_batch(draw, kv_heads: int, seqs: list[tuple[int, int]]) -> Batch:
    """The rest of a decode batch's shape, drawn: block size, group, head size, padding."""
    return Batch(block_size=draw(st.sampled_from([1, 16])), kv_heads=kv_heads,
                 heads=kv_heads * draw(st.sampled_from([1, 3])),
                 head_size=draw(st.sampled_from([40, 64])), seqs=seqs,
                 padding=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)),
                 dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])))  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(batch=split_batches())
def test_split_decode_equals_dense(batch):
    """With fewer (sequence, KV head) pairs than two per thread the kernel splits each
    sequence into parts and merges their softmax states: still dense attention."""
    case = build_case(batch)
    run_and_check(case, CpuPagedAttentionBackend(num_threads=2), TOL[batch.dtype])
    threads = case.meta.cache["cpu_paged"].threads  # what the backend chose for this step
    longest = max(ctx + q for ctx, q in batch.seqs)
    parts = load_cpu_kernels().decode_parts(len(batch.seqs) * batch.kv_heads, longest, threads)
    assert threads == 2 and parts > 1  # the case took the split path


@st.composite
def decode_batches(draw):
    """Decode-only batches as a CPU graph replays them: short contexts (one part per
    sequence) and long ones with few pairs (split into parts)."""
    kv_heads = draw(st.integers(1, 3))
    seqs = [(draw(st.integers(0, 300)), 1) for _ in range(draw(st.integers(1, 5)))]
    return _decode_batch(draw, kv_heads, seqs)


# The default model at batch 1 (3 KV heads of 64, 9 heads): one part per thread, so each
# thread first loads its token range's K/V rows in memory order.
BATCH_ONE = Batch(block_size=16, kv_heads=3, heads=9, head_size=64, seqs=[(100, 1)],
                  padding=0, seed=1, dtype=torch.bfloat16)  # fmt: skip


@settings(max_examples=40, deadline=None)
@example(batch=BATCH_ONE)
@given(batch=decode_batches())
def test_team_decode_in_a_replay_equals_dense(tmp_path_factory, batch):
    """A CPU graph records the KV write and decode as team functions and replays them in
    one OpenMP team (work shared by orphaned loops, split parts merged after a barrier):
    still dense attention, and the same slots written."""
    case = build_case(batch)
    out = torch.full_like(case.q, float("nan"))
    case.layer.impl = CpuPagedAttentionBackend(num_threads=2)
    # Through the attention op, as the model calls it: the capture records the calls the
    # op's entry declares (the backend's `native_calls`).
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={"layer": case.layer})
    )

    def step():
        with set_forward_context(case.meta, config):
            torch.ops.compilecore.unified_attention_with_output(
                case.q, case.k, case.v, out, "layer"
            )
        return out

    _, graph = cpu_graph.capture(step, tmp_path_factory.getbasetemp())
    # team calls for two threads: one region, a barrier between the write and the decode
    assert graph.num_calls == 2 and [(r.team, r.barriers) for r in graph.regions] == [
        (2, (True, False))
    ]
    out.fill_(float("nan"))
    case.layer.kv_cache.copy_(case.cache_before)  # the replay writes the slots again
    check_case(case, graph.replay(), TOL[batch.dtype])


@settings(max_examples=40, deadline=None)
@given(batch=invariant_batches(block_sizes=(1, 16), head_sizes=(40, 64)))
def test_invariant_rows_are_their_decodes_alone(batch):
    """Batch-invariant mode: each decode, and each row of a query of at most
    ROWS_AS_DECODES tokens, gets the bits of the decode at its position run alone
    (split-KV parts from the sequence's own length; rows attended as decodes), and the
    batch is still dense attention."""
    case = build_case(batch)
    backend = CpuPagedAttentionBackend(num_threads=2, invariant=True)
    out = run_and_check(case, backend, TOL[batch.dtype])
    check_rows_as_decodes(case, out, backend, ROWS_AS_DECODES)


def test_without_invariant_splits_a_decode_depends_on_its_batch():
    """The control: with the batch's own split rule (parts from the number of sequences)
    a long decode alone gets other bits than beside three others."""
    batch = Batch(block_size=16, kv_heads=1, heads=4, head_size=64,
                  seqs=[(250, 1), (40, 1), (90, 1), (7, 1)], padding=0, seed=3)  # fmt: skip
    results = []
    for invariant in (True, False):
        case = build_case(batch)
        backend = CpuPagedAttentionBackend(num_threads=2, invariant=invariant)
        out = run_and_check(case, backend, TOL[batch.dtype])
        results.append(torch.equal(out[0], as_decode_alone(case, backend, 0, 0)))
    assert results[0]
    if results[1]:
        pytest.skip("the two split counts happen to give this row the same bits")


def test_bf16_rounding_matches_torch():
    """The kernel's fp32 -> bf16 store rounds like torch (nearest even, NaN kept)."""
    lib = load_cpu_kernels()
    values = torch.tensor(
        [1.0, 1.00390625, 1.01171875, -2.5e-8, 3.3895e38, float("inf"), float("nan"), 0.0]
    )
    # One token, one head, head size = len(values), V = values and K = 0: the output is V.
    d = values.numel()
    cache = torch.zeros(2, 1, 1, 1, d)
    cache[1, 0, 0, 0] = values
    q = torch.zeros(1, d, dtype=torch.bfloat16)
    out = torch.empty(1, d, dtype=torch.bfloat16)
    cache16 = cache.to(torch.bfloat16)
    cache16[1, 0, 0, 0] = values.to(torch.bfloat16)
    seq_lens, table = torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    lib.decode_bf16(q.data_ptr(), d, cache16[0].data_ptr(), cache16[1].data_ptr(),
                    table.data_ptr(), 1, seq_lens.data_ptr(), out.data_ptr(), d, 1, 1, 1, d, 1,
                    ctypes.c_float(1.0), 1, 0)  # fmt: skip
    want = values.to(torch.bfloat16)
    assert torch.equal(out[0, :-2], want[:-2]) and torch.isnan(out[0, -2])
    assert out[0, -1] == 0


PREFILL_HEAD_SIZES = (64, 80, 96, 128, 256)  # cpu_prefill.cpp's instances
needs_prefill_kernel = pytest.mark.skipif(
    load_prefill_kernel() is None, reason="cpu_prefill.cpp needs AVX2 or AVX-512"
)


@st.composite
def prefill_batches(draw):
    """Prefill chunks longer than a task's 32 rows and a block's 32 keys, after cached
    prefixes or none, behind decodes or not, in the kernel's head sizes."""
    kv_heads = draw(st.integers(1, 3))
    seqs = [(draw(st.integers(0, 90)), 1) for _ in range(draw(st.integers(0, 2)))]
    seqs += [(draw(st.integers(0, 100)), draw(st.integers(2, 80)))
             for _ in range(draw(st.integers(1, 2)))]  # fmt: skip
    return Batch(block_size=draw(st.sampled_from([1, 16, 32])), kv_heads=kv_heads,
                 heads=kv_heads * draw(st.sampled_from([1, 2, 3])),
                 head_size=draw(st.sampled_from(PREFILL_HEAD_SIZES)), seqs=seqs,
                 padding=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)),
                 dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])))  # fmt: skip


@needs_prefill_kernel
@settings(max_examples=30, deadline=None)
@example(batch=Batch(block_size=16, kv_heads=2, heads=6, head_size=96, seqs=[(40, 1), (45, 70)],
                     padding=1, seed=2, dtype=torch.bfloat16))  # fmt: skip
@example(batch=Batch(block_size=1, kv_heads=1, heads=2, head_size=256, seqs=[(3, 37)],
                     padding=0, seed=3, dtype=torch.float32))  # fmt: skip
@example(batch=Batch(block_size=32, kv_heads=1, heads=3, head_size=80, seqs=[(0, 33)],
                     padding=0, seed=4, dtype=torch.bfloat16))  # fmt: skip
@given(batch=prefill_batches())
def test_prefill_kernel_equals_dense(batch):
    """cpu_prefill.cpp's chunks (causal over the new rows, all of a cached prefix) are
    dense attention: bf16 dot products on a bf16 cache where the CPU has AVX512-BF16,
    else fp32 multiply-adds, as on fp32 caches."""
    case = build_case(batch)
    run_and_check(case, CpuPagedAttentionBackend(num_threads=2), TOL[batch.dtype])
    assert case.meta.cache["cpu_paged"].chunks  # the kernel took them, not SDPA


@needs_prefill_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prefill_rows_bits_do_not_depend_on_its_chunking(threads, dtype):
    """A row attends over its keys block by block from key 0 whatever chunk it is in and
    on any number of threads: 100 rows in one chunk and as the 63 after 37 cached give the
    same bits (bf16 dot products or fp32 multiply-adds)."""
    outs = []
    for ctx in (0, 37):
        batch = Batch(block_size=16, kv_heads=3, heads=9, head_size=64,
                      seqs=[(ctx, 100 - ctx)], padding=0, seed=5, dtype=dtype)  # fmt: skip
        case = build_case(batch)
        if outs:  # the same queries: the first run's rows from position 37
            case.q.copy_(outs[0][1][ctx:])
        out = run_and_check(case, CpuPagedAttentionBackend(num_threads=threads), TOL[dtype])
        outs.append((out, case.q))
    assert torch.equal(outs[1][0], outs[0][0][37:])


@needs_prefill_kernel
def test_prefill_kernel_says_which_head_sizes_it_has():
    """The kernel names its head sizes (the backend asks it, never a copy of its list);
    a chunk of another head size goes through SDPA and is still dense attention, and
    routed to the kernel regardless it fails closed rather than leave its rows unwritten."""
    lib = load_prefill_kernel()
    assert [d for d in range(8, 520, 8) if lib.prefill_head_size(d)] == list(PREFILL_HEAD_SIZES)
    batch = Batch(block_size=4, kv_heads=1, heads=2, head_size=32, seqs=[(3, 40)], padding=0,
                  seed=6, dtype=torch.bfloat16)  # fmt: skip
    case = build_case(batch)
    run_and_check(case, CpuPagedAttentionBackend(num_threads=2), TOL[batch.dtype])
    step = case.meta.cache["cpu_paged"]
    assert not step.chunks and step.prefill is not None
    forced = CpuPagedAttentionBackend(num_threads=2)
    forced._prefills_natively = lambda layer: True
    case = build_case(batch)
    with pytest.raises(RuntimeError, match="head size 32"):
        forced.forward(case.layer, case.q, case.k, case.v, torch.empty_like(case.q), case.meta)


def _has_avx2() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return platform.machine() == "x86_64" and " avx2" in flags and " fma" in flags


@pytest.mark.skipif(not _has_avx2(), reason="runs an AVX2 build: needs an AVX2 CPU")
@settings(max_examples=20, deadline=None)
@given(batch=batches(**SHAPES) | prefill_batches())
def test_the_kernels_as_avx2_builds_them_equal_dense(tmp_path_factory, batch):
    """Decode and prefill as an AVX2 CPU builds them (`-march=haswell`: 8-float vectors;
    prefill in fp32 multiply-adds, one row a tile), whatever this CPU is, on bf16 and fp32
    caches: this CPU's own build is tested above, another level's only here."""
    decode, prefill = _avx2_builds(tmp_path_factory.getbasetemp())
    backend = CpuPagedAttentionBackend(num_threads=2)
    backend.lib, backend.prefill_lib = decode, prefill
    run_and_check(build_case(batch), backend, TOL[batch.dtype])


@functools.cache
def _avx2_builds(root: Path):
    flags = [f for f in native.FLAGS if not f.startswith("-march")] + ["-march=haswell"]
    return build_cpu_kernels(root, flags), build_prefill_kernel(root, flags)


def test_unsupported_shapes_fall_back_to_torch(backend):
    """fp16 caches and oversized heads take the torch path and stay correct."""
    batch = Batch(block_size=4, kv_heads=1, heads=2, head_size=8, seqs=[(5, 1), (0, 3)],
                  padding=1, seed=1, dtype=torch.float16)  # fmt: skip
    case = build_case(batch)
    assert not backend.supports(case.layer, case.layer.kv_cache)
    run_and_check(case, backend, 1e-2)


def test_auto_selects_cpu_backend_on_cpu():
    from runtime.worker import select_attention_backend

    assert select_attention_backend(torch.device("cpu")).name == "cpu"
    assert select_attention_backend(torch.device("cpu"), "torch").name == "torch"


def test_forced_split_kv_is_refused_where_no_backend_has_it():
    """`attention_num_splits` belongs to the Triton backend: asked of another, or below 1,
    it is an error naming what to do, not a number ignored."""
    from compilecore.config import CacheConfig
    from runtime.worker import select_attention_backend

    for backend in ("auto", "torch", "cpu"):
        with pytest.raises(ValueError, match="attention_backend='triton'"):
            select_attention_backend(torch.device("cpu"), backend, num_splits=4)
    with pytest.raises(ValueError, match="at least 1"):
        CacheConfig(attention_num_splits=0)


def test_engine_greedy_cpu_equals_torch(tiny_llama):
    prompts = [[5, 6, 7, 8, 9], [42], [100 + i for i in range(20)]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name in ("torch", "cpu"):
        llm = LLM(str(tiny_llama[0]), enforce_eager=True, attention_backend=name)
        assert llm.llm_engine.runner.attn_backend.name == name
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["cpu"] == outs["torch"]


def test_loading_the_kernels_keeps_denormals(tmp_path):
    """Linking with -ffast-math would load crtfastmath.o, which switches the whole process
    to flush-to-zero: every later float computation (and hypothesis) would change."""
    load_cpu_kernels.cache_clear()
    load_cpu_kernels(tmp_path)  # a fresh build
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0
