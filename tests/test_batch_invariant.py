"""Batch-invariant mode: a request's tokens and logprobs are bit-identical whatever else is
in its batch (vLLM's `VLLM_BATCH_INVARIANT=1`)."""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilecore import testing
from compilecore.config import CompilationConfig
from compilecore.testing import count_ops
from passes.batch_invariant import BatchInvariantPass
from passes.ops.invariant_mm import invariant_mm

SHAPES = [(64, 96), (256, 160), (576, 1536)]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    rows=st.integers(1, 40),
    data=st.data(),
)
def test_a_row_of_the_product_is_the_same_in_any_batch(shape, rows, data):
    """Row r of `invariant_mm` over any number of rows equals the same row's product alone,
    bit for bit, and both are the product."""
    k, n = shape
    pos = data.draw(st.integers(0, rows - 1))
    g = torch.Generator().manual_seed(rows * 1000 + pos)
    w, a = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    batched = invariant_mm(a, w.t())
    alone = invariant_mm(a[pos : pos + 1], w.t())
    assert torch.equal(batched[pos], alone[0])
    torch.testing.assert_close(batched, a @ w.t(), rtol=1e-5, atol=1e-4)


def test_the_pass_rewrites_every_product():
    """Against the unfused graph: a product without and with a bias, each one op."""
    g = torch.Generator().manual_seed(0)
    w1, w2, b = (torch.randn(32, 48, generator=g), torch.randn(16, 32, generator=g),
                 torch.randn(16, generator=g))  # fmt: skip

    def fn(x):
        return torch.nn.functional.linear(torch.relu(x @ w1.t()), w2, b)

    backend = testing.check_pass(BatchInvariantPass(), fn, torch.randn(5, 48, generator=g))
    assert backend.matches("batch_invariant") == 2
    assert count_ops(backend.graph_after, torch.ops.compilecore.invariant_mm) == 2
    for op in (torch.ops.aten.mm, torch.ops.aten.addmm):
        assert count_ops(backend.graph_after, op) == 0


PROMPT_LENS = [1, 3, 9, 17, 30, 41, 58, 64]


@functools.cache
def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in PROMPT_LENS]


def _params(kind: int):
    from runtime import SamplingParams

    if kind == 0:  # greedy, with logprobs
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    # seeded samples, and other lengths: requests finish at other steps
    return SamplingParams(temperature=0.9, top_p=0.9, seed=kind, max_tokens=5 + 3 * kind,
                          ignore_eos=True, logprobs=1)  # fmt: skip


def _result(out):
    completion = out.outputs[0]
    logprobs = [sorted((t, lp.logprob) for t, lp in step.items()) for step in completion.logprobs]
    return completion.token_ids, logprobs


def _alone(llm) -> dict:
    """Each (prompt, kind) request's result run by itself."""
    return {(i, kind): _result(llm.generate([prompt], _params(kind), use_tqdm=False)[0])
            for i, prompt in enumerate(_prompts()) for kind in range(3)}  # fmt: skip


@pytest.fixture(scope="module")
def invariant_llm(tiny_llama, tmp_path_factory):
    """A compiled engine in batch-invariant mode whose budget cuts the longer prompts into
    chunks (40 tokens a step: chunks of 40), and each request's result alone."""
    from runtime import LLM

    llm = LLM(str(tiny_llama[0]), max_model_len=128, max_num_batched_tokens=40, max_num_seqs=8,
              compilation_config={"batch_invariant": True,
                                  "cache_dir": str(tmp_path_factory.mktemp("bi"))})  # fmt: skip
    return llm, _alone(llm)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(mixture=st.lists(st.tuples(st.integers(0, len(PROMPT_LENS) - 1), st.integers(0, 2)),
                        min_size=2, max_size=8))  # fmt: skip
def test_any_mixture_of_requests_gives_each_its_result_alone(invariant_llm, mixture):
    """Greedy and seeded sampled requests of 1 to 64 prompt tokens, in any number and
    order: prompts chunked beside others' decodes, batches that shrink as requests finish.
    Each request's tokens and logprobs are the ones it gets alone."""
    llm, alone = invariant_llm
    prompts = [_prompts()[i] for i, _ in mixture]
    outs = llm.generate(prompts, [_params(kind) for _, kind in mixture], use_tqdm=False)
    for (i, kind), out in zip(mixture, outs):
        assert _result(out) == alone[i, kind], (i, kind)


def test_decode_steps_in_the_mode_replay_cpu_graphs(invariant_llm):
    """The mode's products (`invariant_mm` through AOTInductor's shim) and attention (the
    C++ kernels with each sequence's own splits) are recordable: batched decode steps
    replay CPU graphs, and the mixture test above holds across graphs and pieces."""
    from compilecore.counters import compilation_counter

    llm, alone = invariant_llm
    replays = compilation_counter.num_cpu_graph_replays
    outs = llm.generate(_prompts()[:4], _params(0), use_tqdm=False)
    assert compilation_counter.num_cpu_graph_replays > replays
    assert [_result(out) for out in outs] == [alone[i, 0] for i in range(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 17])
def test_the_recorded_tiles_write_the_ops_bits(dtype, m):
    """`invariant_mm`'s declared call (made at capture, in inference mode) writes, when a
    replay runs it outside inference mode, exactly the op's own result."""
    from passes.native_calls import native_entry

    g = torch.Generator().manual_seed(m)
    a = torch.randn(m, 96, generator=g).to(dtype)
    b = torch.randn(160, 96, generator=g).to(dtype).t()  # a weight's transpose, as linear
    with torch.inference_mode():
        out = torch.ops.compilecore.invariant_mm(a, b)
        want = out.clone()
        call = native_entry("compilecore::invariant_mm")((a, b), out)
        out.fill_(float("nan"))
    call.run()
    assert torch.equal(out, want)


def test_preempted_requests_recompute_their_own_bits(invariant_llm, tiny_llama, tmp_path):
    """A KV cache of 8 blocks (128 tokens) for 8 requests: requests are preempted after
    generating and recomputed (prompt in its own chunks, then the generated tokens as rows
    that attend as the decodes that made them); each still gets its tokens and logprobs
    alone."""
    from runtime import LLM

    _, alone = invariant_llm
    cc = {"batch_invariant": True, "cache_dir": str(tmp_path)}
    small = LLM(str(tiny_llama[0]), max_model_len=128, max_num_batched_tokens=40,
                max_num_seqs=8, kv_cache_memory=8 * 8192, compilation_config=cc)  # fmt: skip
    assert small.llm_engine.scheduler.block_manager.num_blocks == 8
    kinds = [i % 3 for i in range(len(PROMPT_LENS))]
    outs = small.generate(_prompts(), [_params(k) for k in kinds], use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for i, (kind, out) in enumerate(zip(kinds, outs)):
        assert _result(out) == alone[i, kind], (i, kind)


def test_without_the_mode_a_batch_changes_the_numbers(tiny_llama, tmp_path):
    """The control: the same engine without the mode gives other logprobs in a batch (the
    test above can fail). Skipped, with the reason, on a machine where it happens not to."""
    from runtime import LLM

    cc = {"batch_invariant": False, "cache_dir": str(tmp_path)}
    llm = LLM(str(tiny_llama[0]), max_model_len=128, compilation_config=cc)
    params = _params(0)
    prompts = _prompts()
    alone = [_result(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    together = [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    if alone == together:
        pytest.skip("this CPU's kernels happen to give every row the same bits in any batch")
    assert alone != together


def test_the_mode_is_set_by_vllms_variable_and_refuses_what_it_cannot_keep(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert CompilationConfig().batch_invariant and CompilationConfig().passes.batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not CompilationConfig().batch_invariant
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert CompilationConfig(batch_invariant=True).passes.resolved("cpu") | {
        "batch_invariant": True, "native_linear": False, "gemv_to_reduction": False,
        "packed_linear": False, "quantized_linear": True,
    } == CompilationConfig(batch_invariant=True).passes.resolved("cpu")  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"compilation_config": {"batch_invariant": True, "compile_sizes": [1]}}, "compile_sizes"),
        ({"compilation_config": {"batch_invariant": True, "mode": "none"}}, "mode='none'"),
        ({"compilation_config": {"batch_invariant": True, "cpu_graph_sizes": [8, 32]}},
         "cpu_graph_sizes [32]"),
    ],
)  # fmt: skip
def test_settings_the_mode_cannot_keep_are_errors_naming_them(tiny_llama, setting, named):
    from runtime.llm import build_engine_config

    with pytest.raises(ValueError, match="batch_invariant") as info:
        build_engine_config(str(tiny_llama[0]), **setting)
    assert named in str(info.value)


def _chunks(config, companions: int) -> list[int]:
    """The chunk sizes a 70-token prompt gets, after `companions` 20-token prompts that
    are then decoding beside it."""
    from runtime.request import Request
    from runtime.sampling_params import SamplingParams
    from runtime.scheduler import Scheduler

    sched = Scheduler(config.scheduler_config, config.cache_config, num_blocks=64)
    params = SamplingParams(max_tokens=50)
    for i in range(companions):
        sched.add_request(Request(f"c{i}", list(range(3, 23)), params))
    long = Request("long", list(range(3, 73)), params)
    sched.add_request(long)
    chunks = []
    while long.num_computed_tokens < long.num_tokens:
        out = sched.schedule()
        chunks += [s.num_new_tokens for s in out.scheduled if s.request is long]
        if config.scheduler_config.invariant_chunk is not None:  # one kind of rows a step
            sizes = [s.num_new_tokens for s in out.scheduled]
            assert all(n > 16 for n in sizes) or (max(sizes) <= 16 and sum(sizes) <= 16)
        sched.advance(out)
        for s in out.scheduled:  # each finished prompt gets one token, as a step gives
            if s.request.num_computed_tokens == s.request.num_tokens:
                s.request.output_token_ids.append(7)
    return chunks


def test_a_prompt_is_chunked_where_it_is_chunked_alone(tiny_llama):
    """The scheduler's part: chunks of 40 (the budget: long chunks run in steps of their
    own) for a 70-token prompt alone and beside others' prefill and decode rows, every
    step either short queries (at most 16 rows in all) or long chunks; without the mode
    the cuts move with the company (the control)."""
    from runtime.llm import build_engine_config

    def config(invariant):
        return build_engine_config(str(tiny_llama[0]), max_num_batched_tokens=40,
                                   max_num_seqs=8, max_model_len=128,
                                   compilation_config={"batch_invariant": invariant})  # fmt: skip

    invariant = config(True)
    assert invariant.scheduler_config.invariant_chunk == 40
    assert not invariant.cache_config.enable_prefix_caching
    assert invariant.compilation_config.compile_sizes == []
    assert [_chunks(invariant, n) for n in (0, 1, 3)] == [[40, 30]] * 3
    assert _chunks(config(False), 0) != _chunks(config(False), 1)


def test_start_up_check_fails_closed_on_a_variant_gemm(monkeypatch, tiny_llama):
    """The check passes for one tile a call and refuses, naming the shape, when a product
    is one call over all its rows (the library's kernel then depends on the row count),
    where this machine's GEMM shows it. The worker's start-up check (run in this mode
    before compiling) covers every product shape: QKV, o, gate_up, down and the head."""
    from passes.ops import invariant_mm as op
    from runtime import LLM
    from runtime.worker import check_invariant_products

    llm = LLM(str(tiny_llama[0]), enforce_eager=True)
    config, model = llm.engine_config, llm.llm_engine.model
    checked = []
    real = op.check_rows
    monkeypatch.setattr(op, "check_rows", lambda *a: checked.append(a[:2]) or real(*a))
    check_invariant_products(model, config)
    hf = tiny_llama[1].config
    h, inter, d = hf.hidden_size, hf.intermediate_size, hf.hidden_size // hf.num_attention_heads
    qkv = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * d
    assert set(checked) == {(h, qkv), (h, h), (h, 2 * inter), (inter, h), (h, hf.vocab_size)}
    monkeypatch.setattr(op, "check_rows", real)
    shape = (576, 1536)  # the default model's gate_up input
    op.check_rows(*shape, torch.float32)
    monkeypatch.setattr(op, "invariant_mm", lambda a, b, tile: a @ b)  # one call, any rows
    a = torch.randn(48, shape[0])
    b = torch.randn(shape[0], shape[1])
    if all(torch.equal(torch.mm(a[:m], b), torch.mm(a, b)[:m]) for m in op.CHECKED_ROWS):
        pytest.skip("this machine's GEMM gives every row count the same bits")
    with pytest.raises(op.NotBatchInvariant, match=r"\[576 x 1536\] torch.float32"):
        op.check_rows(*shape, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_query_rows_attend_as_the_decodes_they_stand_for(dtype, monkeypatch):
    """Batch-invariant mode's attention: each row of a 4-token query over a cached
    context (a speculative verification) has the bits a decode at that position gets
    alone; with such queries left to the chunk path (the control) some row differs."""
    from runtime.attention import TorchPagedAttentionBackend, torch_paged
    from runtime.attention.metadata import AttentionMetadata
    from tests.attention_cases import Batch, build_case

    def rows_and_decodes():
        batch = Batch(block_size=4, kv_heads=2, heads=4, head_size=16, seqs=[(1, 1), (9, 4)],
                      padding=0, seed=5, dtype=dtype)  # fmt: skip
        case = build_case(batch)
        backend = TorchPagedAttentionBackend(per_sequence=True)
        out = torch.empty_like(case.q)
        backend.forward(case.layer, case.q, case.k, case.v, out, case.meta)
        decodes = []
        for j in range(4):  # the query's rows, each alone as a decode at its position
            length = 9 + j + 1
            meta = AttentionMetadata(
                num_actual_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                seq_lens=torch.tensor([length], dtype=torch.int32),
                slot_mapping=torch.tensor([-1]), block_table=case.meta.block_table[1:2],
                max_query_len=1, max_seq_len=length, num_decodes=1,
                query_start_loc_cpu=[0, 1], seq_lens_cpu=[length],
            )  # fmt: skip
            alone = torch.empty_like(case.q[:1])
            row = case.q[1 + j : 2 + j]
            backend.forward(case.layer, row, case.k[:1], case.v[:1], alone, meta)
            decodes.append(alone[0])
        return out[1:5], torch.stack(decodes)

    verified, decoded = rows_and_decodes()
    assert torch.equal(verified, decoded)
    monkeypatch.setattr(torch_paged, "ROWS_AS_DECODES", 0)
    verified, decoded = rows_and_decodes()
    if torch.equal(verified, decoded):
        pytest.skip("the chunk path gives these rows the decodes' bits here")


@pytest.fixture(scope="module")
def invariant_gguf(tiny_gguf, tiny_llama, tmp_path_factory):
    """A GGUF model (Q4_1, Q4_0 and Q8_0 layers) in batch-invariant mode, and each
    request's result alone."""
    from runtime import LLM

    llm = LLM(str(tiny_gguf[0]), tokenizer=str(tiny_llama[0]), max_model_len=128,
              max_num_batched_tokens=40, max_num_seqs=8,
              compilation_config={"batch_invariant": True,
                                  "cache_dir": str(tmp_path_factory.mktemp("bq"))})  # fmt: skip
    return llm, _alone(llm)


def test_quantized_models_read_the_blocks_and_keep_each_requests_bits(invariant_gguf):
    """Where our quantized products run, the mode keeps them (the row products at every
    row count: 0.26x the default's batch-1 speed when the weights were dequantized whole
    every step) and every request's tokens and logprobs are still its own alone, in
    mixtures and orders hypothesis would draw (a few fixed ones: each costs a compile-free
    run)."""
    from compilecore.counters import compilation_counter
    from tests.helpers import native_quantized_products

    llm, alone = invariant_gguf
    replays = compilation_counter.num_cpu_graph_replays
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([_prompts()[2]], _params(0), use_tqdm=False)
    replays = compilation_counter.num_cpu_graph_replays - replays
    calls = {e.key: e.count for e in prof.key_averages()}
    steps = _params(0).max_tokens  # one prefill chunk, then a decode a token
    products = calls.get("compilecore::q4_linear", 0) + calls.get("compilecore::q8_linear", 0)
    # Decode steps replay a CPU graph (its batch-1 graph captured by the fixture's runs),
    # which holds the same products' calls.
    graph = llm.llm_engine.runner.cpu_graphs.get(1)
    recorded = sum(info.what in ("compilecore.q4_linear", "compilecore.q8_linear")
                   for info in graph.described) if graph else 0  # fmt: skip
    # 4 a layer, and layer 1's QKV held per part (q and k Q4_1, v Q8_0): two more
    if native_quantized_products():
        assert (products, recorded, replays) == (10, 10, steps - 1)
    else:
        assert products == recorded == 0
    for mixture in ([(0, 0), (3, 1), (5, 2), (1, 0)], [(4, 2), (4, 0), (2, 1), (0, 2), (5, 0),
                                                      (1, 1), (3, 0), (2, 2)]):  # fmt: skip
        prompts = [_prompts()[i] for i, _ in mixture]
        outs = llm.generate(prompts, [_params(kind) for _, kind in mixture], use_tqdm=False)
        for (i, kind), out in zip(mixture, outs):
            assert _result(out) == alone[i, kind], (i, kind)


def test_the_start_up_check_covers_every_block_format(tiny_gguf, tiny_llama, monkeypatch):
    """The worker checks each quantized format and shape on the model's own weights
    (`check_invariant_blocks`); a kernel whose rows depended on the row count (the
    default products: int8 activations, strips, a dense GEMM past the row products) is
    refused by name."""
    from models.layers.quantization import QuantFormat
    from passes.ops.invariant_mm import NotBatchInvariant
    from runtime import LLM
    from runtime.worker import check_invariant_blocks
    from tests.helpers import native_quantized_products

    if not native_quantized_products():
        pytest.skip("our quantized products do not run here")
    llm = LLM(str(tiny_gguf[0]), tokenizer=str(tiny_llama[0]), enforce_eager=True)
    config, model = llm.engine_config, llm.llm_engine.model
    checked = []
    real = QuantFormat.product
    monkeypatch.setattr(
        QuantFormat,
        "product",
        lambda self, *a, **k: checked.append(self.bits) or real(self, *a, **k),
    )
    check_invariant_blocks(model, config)
    assert set(checked) == {4, 8}

    def variant(self, x, fields, bias=None, out_dtype=None, int8_x=False, invariant=False):
        return real(self, x, fields, bias, out_dtype, True, False)  # the default's paths

    monkeypatch.setattr(QuantFormat, "product", variant)
    with pytest.raises(NotBatchInvariant, match="read from the blocks"):
        check_invariant_blocks(model, config)


_TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@pytest.mark.skipif(not _TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_the_triton_products_give_a_row_its_bits_in_any_batch(rows, dtype, seed):
    """On CUDA the mode's products are Triton kernels with one tile for every row count
    (`invariant_mm`'s, and the quantized products' INVARIANT_TILE; cuBLAS picks kernels by
    shape): row r among any number of rows has the bits it has among 48, and the products
    are still the reference's."""
    from models.layers.quantization import QuantFormat, quantize
    from passes.ops.invariant_mm import invariant_mm_triton
    from passes.ops.triton_quant import INVARIANT_TILE, quant_linear_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(48, 96, generator=g).to(dtype).to(device)
    b = torch.randn(96, 80, generator=g).to(dtype).to(device)
    full = invariant_mm_triton(a, b)
    assert torch.equal(invariant_mm_triton(a[:rows], b), full[:rows])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), a.float() @ b.float(), rtol=tol, atol=tol * 10)
    fmt = QuantFormat(4, 32)
    fields = quantize(torch.randn(80, 96, generator=g), fmt)
    w, *rest = (fields[name].to(device) for name in fmt.names())
    y = quant_linear_triton(a, w, tuple(rest), tile=INVARIANT_TILE)
    assert torch.equal(quant_linear_triton(a[:rows], w, tuple(rest), tile=INVARIANT_TILE),
                       y[:rows])  # fmt: skip


@pytest.mark.skipif(not _TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_the_default_triton_tiles_follow_the_row_count():
    """The control: the quantized product's default tiles (one row: multiply-adds; more:
    tl.dot) give a row alone other bits than among 48."""
    from models.layers.quantization import QuantFormat, quantize
    from passes.ops.triton_quant import quant_linear_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    a = torch.randn(48, 256, generator=g).to(device)
    fmt = QuantFormat(4, 32)
    fields = quantize(torch.randn(80, 256, generator=g), fmt)
    w, *rest = (fields[name].to(device) for name in fmt.names())
    alone = quant_linear_triton(a[:1], w, tuple(rest))
    among = quant_linear_triton(a, w, tuple(rest))
    if torch.equal(alone, among[:1]):
        pytest.skip("the default tiles happen to give this row the same bits here")
    assert not torch.equal(alone, among[:1])
