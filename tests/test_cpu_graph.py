"""CPU graphs (compilecore/cpu_graph.py): a decode step's native calls recorded once and
replayed from C. The oracle is the same compiled engine without graphs (and HF); the
capture must refuse anything it could not replay, naming it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compilecore import cpu_graph
from compilecore.compile_cache import compile_cache_root
from compilecore.cpu_graph_regions import form_regions, region_stats
from passes import native_calls
from passes.native_calls import NativeCall
from runtime import LLM, SamplingParams
from runtime.huge_pages import pack_parameters
from tests.helpers import hf_greedy, native_cpu_kernels

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31, 8]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def compiled(tiny_llama, tmp_path_factory):
    """One compiled bf16 engine whose CPU graph is switched on and off between runs."""
    cache = tmp_path_factory.mktemp("cpu_graph_cache")
    return LLM(
        str(tiny_llama[0]),
        dtype="bfloat16",
        block_size=4,  # 40 tokens cross many blocks: the replay must follow the table
        compilation_config={"cache_dir": str(cache)},
    )


def _tokens(llm: LLM, params=GREEDY) -> list[int]:
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def test_decode_replays_one_graph_equal_to_piecewise(compiled):
    runner = compiled.llm_engine.runner
    runner.cpu_graphs.clear()
    with_graph = _tokens(compiled)
    graph = runner.cpu_graphs[1]
    assert isinstance(graph, cpu_graph.CpuGraph)
    layers = compiled.engine_config.model_config.hf_config.num_hidden_layers
    # The first piece: Inductor's kernel (embedding + norm), QKV, RoPE; each middle piece:
    # o_proj, add + norm, gate_up, SiLU-and-mul, down, add + norm, QKV, RoPE; the last:
    # the same up to the final norm; a KV write and a decode per layer; the LM head.
    # Nothing else runs in a decode step. Without our kernels (no AVX-512) each piece and
    # the head are one Inductor kernel each.
    if native_cpu_kernels():
        assert graph.num_calls == 3 + 8 * (layers - 1) + 6 + 2 * layers + 1
    else:
        assert graph.num_calls == (layers + 1) + 2 * layers + 1
    runner.cpu_graphs[1] = None  # piece by piece, through Python
    assert _tokens(compiled) == with_graph
    runner.cpu_graphs[1] = graph


def test_latency_benchmark_counts_the_bytes_a_step_reads(compiled):
    """bench_latency's GB/s and shares count what each engine reads a token: a greedy
    step of ours reads the head through its int8 screen, a sampled one the whole head."""
    from passes.ops import gemv
    from tests.test_benchmarks import _load

    common = _load("common")
    _tokens(compiled)
    full = common.weight_bytes(compiled)
    assert common.bytes_read_per_token(compiled, {"temperature": 0.8, "top_p": 0.95}) == full
    head = compiled.llm_engine.model.lm_head.weight
    greedy = common.bytes_read_per_token(compiled, None)
    if gemv.screen_available():
        screen = gemv.screen_bytes(head)
        assert greedy == full - head.numel() * 2 + screen < full
    else:
        assert greedy == full


def test_replayed_logits_equal_piecewise_logits_every_step(compiled):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runner = compiled.llm_engine.runner
    # Both runs below must find the prompt's full blocks in the prefix cache: a prompt
    # prefilled whole and one whose last token runs as a decode over cached blocks take
    # different attention kernels, equal only to bf16 rounding.
    compiled.generate([PROMPT], params, use_tqdm=False)
    replayed = compiled.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert isinstance(runner.cpu_graphs[1], cpu_graph.CpuGraph)
    saved, runner.cpu_graphs[1] = runner.cpu_graphs[1], None
    piecewise = compiled.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    runner.cpu_graphs[1] = saved
    assert replayed.token_ids == piecewise.token_ids
    for got, want in zip(replayed.logprobs, piecewise.logprobs):
        assert got.keys() == want.keys()
        for token in want:
            assert abs(got[token].logprob - want[token].logprob) < 1e-6


def test_plain_greedy_reads_the_screened_head_and_keeps_every_token(compiled):
    """Plain greedy steps take the LM head's screened path (passes/ops/gemv.py); a request
    with logprobs gets every logit. Their tokens are the same, replayed and piece by
    piece, and after the weights are reloaded in place (the screen is made again)."""
    from models.loader import iterate_weights
    from passes.ops import derived, gemv

    full = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    runner = compiled.llm_engine.runner
    head = runner.model.lm_head.weight
    for graphs in (True, False):
        saved = runner.cpu_graphs.get(1)
        if not graphs:
            runner.cpu_graphs[1] = None
        assert _tokens(compiled) == _tokens(compiled, full)
        runner.cpu_graphs[1] = saved
    if gemv.screen_available():
        assert derived.current(head, "head_screen") is not None
    files = sorted(Path(compiled.engine_config.model_config.model).glob("*.safetensors"))
    try:
        runner.model.load_weights((n, t.flip(0)) for n, t in iterate_weights(files))
        assert _tokens(compiled) == _tokens(compiled, full)
    finally:
        runner.model.load_weights(iterate_weights(files))
        _tokens(compiled)  # records the graph again: later tests start from a steady engine


class _TorchCalls(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_a_replayed_step_calls_no_torch_function_outside_the_graph(compiled, monkeypatch):
    """Right after the weights stream through the caches each torch call costs tens of
    microseconds (docs/kernel-choices.md, Host time): the runner writes a replayed step's inputs
    through numpy views and hands back the graph's own output buffer. The weight watch's reads
    (each tensor's version counter and address: C getters, no dispatch, ~0.06 us each) are
    counted apart."""
    runner = compiled.llm_engine.runner
    execute, seen, checks = runner.execute, [], []
    check = runner.weight_watch.check

    def check_unwatched():
        checks.append(1)
        with torch._C.DisableTorchFunction():
            return check()

    monkeypatch.setattr(runner.weight_watch, "check", check_unwatched)

    def watched(plan, feed=None):
        size = runner._cpu_graph_size(plan)  # a first replay is checked piece by piece
        replayed = isinstance(runner.cpu_graphs.get(size), cpu_graph.CpuGraph)
        replayed = replayed and size not in runner._unchecked
        with _TorchCalls() as mode:
            out = execute(plan, feed)
        if replayed:
            seen.append(mode.calls)
        return out

    monkeypatch.setattr(runner, "execute", watched)
    # Enough tokens for 4 replays where this test is the first to step this engine (its
    # graph captured, then its first replay checked piece by piece, in these steps).
    _tokens(compiled, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(seen) >= 4 and all(calls == [] for calls in seen), seen
    assert len(checks) >= len(seen)  # every step checked the weights


def test_graph_matches_hf_in_fp32(tiny_llama, tmp_path):
    path, hf = tiny_llama
    llm = LLM(str(path), compilation_config={"cache_dir": str(tmp_path)})
    got = _tokens(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert isinstance(llm.llm_engine.runner.cpu_graphs[1], cpu_graph.CpuGraph)
    assert got == hf_greedy(hf, PROMPT, 24)


def test_torch_attention_backend_is_refused_and_still_correct(tiny_llama, tmp_path):
    path, hf = tiny_llama
    llm = LLM(str(path), attention_backend="torch", compilation_config={"cache_dir": str(tmp_path)})
    got = _tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.llm_engine.runner.cpu_graphs[1] is None  # Python attention: not capturable
    assert got == hf_greedy(hf, PROMPT, 12)


def test_capture_refuses_compute_outside_kernels(tmp_path):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="mm"):
        cpu_graph.capture(lambda: torch.mm(a, b), tmp_path)
    assert not cpu_graph.is_capturing()


def _compile(fn, args, hooked: bool):
    from torch.fx.experimental.proxy_tensor import make_fx

    from compilecore.wrapper_codegen import recorded_kernel_calls

    graph = make_fx(fn)(*args)
    options = {"config_patches": {"force_disable_caches": True}}
    with recorded_kernel_calls() if hooked else contextlib.nullcontext():
        return torch._inductor.standalone_compile(
            graph, list(args), dynamic_shapes="from_example_inputs", options=options
        )


def test_kernels_of_code_our_backend_compiles_are_recorded_and_replayed(tmp_path):
    """While our backend compiles, Inductor writes each C++ kernel call through
    `cpu_graph.kernel_call`: the capture records it (no module global patched, no profile
    hook). Code compiled outside that (plain `torch.compile`) calls its kernels directly:
    the capture counts them run and not recorded, and refuses as a sign of a torch that
    bypasses the hook."""
    from torch._inductor.codegen import common

    def f(x, y):  # two kernels: a reduction, then a pointwise op over it
        return (torch.relu(x) * y / (x * x).sum(-1, keepdim=True),)

    x, y = torch.randn(8, 64), torch.randn(8, 64)
    ours, theirs = _compile(f, (x, y), hooked=True), _compile(f, (x, y), hooked=False)
    assert common.device_codegens["cpu"].wrapper_codegen.__name__ == "PythonWrapperCodegen"
    (out,), graph = cpu_graph.capture(lambda: ours(x, y), tmp_path)
    assert graph.num_calls >= 1
    assert all(info.what.startswith("Inductor kernel") for info in graph.described)
    # each call names the kernel in the wrapper Inductor wrote: its `cpp_fused_...`
    assert all(info.source.startswith("cpp_fused_") for info in graph.described)
    x.copy_(torch.randn(8, 64))
    y.copy_(torch.randn(8, 64))
    assert torch.equal(graph.replay()[0], out)
    torch.testing.assert_close(out, f(x, y)[0])
    assert torch.equal(out, ours(x, y)[0])
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="kernels ran and 0 were") as err:
        cpu_graph.capture(lambda: theirs(x, y), tmp_path)
    assert err.value.alarming


@pytest.mark.parametrize("counted", [True, False])
def test_a_hook_that_records_no_kernel_yields_no_graph_and_the_right_tokens(
    compiled, tiny_llama, tmp_path, monkeypatch, caplog, counted
):
    """What a torch release that routes Inductor's kernel calls elsewhere would do: the
    hook passes the calls through unrecorded. The capture still records the attention
    calls, and its replay read the capture's values left in the kernels' buffers and
    passed its check (greedy tokens then went wrong). Now the capture counts the
    Inductor kernels that ran against those recorded: no graph, one warning naming torch,
    the right tokens. With the count blinded (`counted=False`), the graph's first replay
    on new token ids, checked against the step run piece by piece, refuses it the same way;
    replays of the capture's own token (a request held to one token) read the embedding's
    stale output as right and must not end the check (they did: wrong tokens after)."""
    from compilecore import wrapper_codegen

    if not counted:
        monkeypatch.setattr(cpu_graph._KernelsRun, "_event", lambda self, *event: None)

    def passthrough(self, name, call_args):
        return super(wrapper_codegen._HookedCalls, self).wrap_kernel_call(name, call_args)

    monkeypatch.setattr(wrapper_codegen._HookedCalls, "wrap_kernel_call", passthrough)
    # Inductor's cache must not hand back code written through the real hook.
    monkeypatch.setattr(wrapper_codegen, "CODEGEN_KEY", wrapper_codegen.CODEGEN_KEY + " (off)")
    llm = LLM(str(tiny_llama[0]), dtype="bfloat16", block_size=4,
              compilation_config={"cache_dir": str(tmp_path)})  # fmt: skip
    with caplog.at_level("WARNING", logger="compilecore"):
        if not counted:
            one = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                 allowed_token_ids=[PROMPT[0]])  # fmt: skip
            assert llm.generate([PROMPT], one, use_tqdm=False)[0].outputs[0].token_ids == [
                PROMPT[0]] * 4  # fmt: skip
            # Replayed, still checked; or refused already where an unrecorded kernel reads
            # the position (RoPE in Inductor's code: CPUs without the AVX-512 layer kernels)
            if llm.llm_engine.runner.cpu_graphs[1] is None:
                assert "first replay differs" in caplog.text
        got = _tokens(llm)
    assert llm.llm_engine.runner.cpu_graphs[1] is None
    assert f"torch {torch.__version__}" in caplog.text
    assert ("kernels ran" if counted else "first replay differs") in caplog.text
    runner = compiled.llm_engine.runner
    graph = runner.cpu_graphs.pop(1, None)
    try:
        runner.cpu_graphs[1] = None  # the oracle: the shared engine piece by piece
        assert got == _tokens(compiled)
    finally:
        runner.cpu_graphs[1] = graph


# A test op whose declared entry is whatever call a test puts in _DECLARED[index] (or the
# refusal it names): the op itself computes nothing, so only a replay does the work.
_DECLARED: list = []
_TEST_LIB = torch.library.Library("cpu_graph_test", "FRAGMENT")
_TEST_LIB.define("declared(Tensor anchor, int index) -> ()")
_TEST_LIB.impl("declared", lambda anchor, index: None, "CPU")


def _declared_entry(args: tuple, out: None):
    call = _DECLARED[args[1]]
    if isinstance(call, str):
        raise native_calls.Unrecordable(call)
    return call


native_calls.declare_entry("cpu_graph_test::declared", _declared_entry)


def _declare(call) -> None:
    """Run the test op for `call` (a NativeCall, a sequence of them, or a refusal)."""
    _DECLARED.append(call)
    torch.ops.cpu_graph_test.declared(torch.empty(0), len(_DECLARED) - 1)


def test_capture_refuses_an_op_that_declares_nothing(tmp_path):
    lib = torch.library.Library("cpu_graph_test", "FRAGMENT")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")
    x = torch.ones(3)
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="declares no native call"):
        cpu_graph.capture(lambda: torch.ops.cpu_graph_test.double(x), tmp_path)


def test_capture_refuses_an_unrecordable_call_and_empty_programs(tmp_path):
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="nothing was recorded"):
        cpu_graph.capture(lambda: None, tmp_path)
    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="prefill"):
        cpu_graph.capture(lambda: _declare("prefill runs in Python"), tmp_path)
    assert not cpu_graph.is_capturing()


def test_declared_native_call_is_replayed(tmp_path):
    """A native op declares its C function and arguments; the replay calls it again on
    whatever its buffers hold then."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    call = NativeCall(native_calls.function_address(libc.memcpy), (dst, src, 32), "memcpy", 0,
                      libc.memcpy)  # fmt: skip

    def step():
        _declare(call)
        dst.copy_(src)  # the eager run does the same work (a copy is not a compute op here)
        return dst

    with pytest.raises(cpu_graph.CpuGraphUnsupported, match="copy_"):
        cpu_graph.capture(step, tmp_path)

    def declared_only():
        _declare(call)
        return dst

    _, graph = cpu_graph.capture(declared_only, tmp_path)
    src += 100
    assert torch.equal(graph.replay(), src)
    assert graph.num_calls == 1
    src += 1
    call.run()  # the op's own way to make the call: the same function and arguments
    assert torch.equal(dst, src)


def test_a_declared_op_called_with_a_keyword_after_a_skipped_default_is_recorded(tmp_path):
    """`q8_linear(x, w, scales, int8_x=True)` skips bias and out_dtype: the dispatcher hands
    the capture every argument in the schema's order (defaults filled in), so the declared
    entry records the call the op made (int8 activations on Q8_0's strips where the CPU
    has them) and its replay gives the eager result bit for bit."""
    from passes.ops import quantized

    g = torch.Generator().manual_seed(0)
    n, k = 32, 128
    x = torch.randn(8, k, generator=g).bfloat16()
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half()
    op = torch.ops.compilecore.q8_linear
    if quantized._kernel() is None:
        pytest.skip("the quantized kernels do not build here")
    want = op(x, w, s, None, None, True)
    out, graph = cpu_graph.capture(lambda: op(x, w, s, int8_x=True), tmp_path)
    assert torch.equal(out, want) and graph.num_calls == 1
    out.zero_()
    assert torch.equal(graph.replay(), want)
    if quantized.int8_strips():  # the keyword reached the kernel: not the exact product
        assert not torch.equal(want, op(x, w, s))


TEAM_SOURCE = r"""
#include <cstdint>
#include <omp.h>
#include <unistd.h>
extern "C" {
// Each thread writes its number + 1, all but the first after a delay.
void mark(int64_t* slots) {
  const int t = omp_get_thread_num();
  if (t) usleep(20000);
  slots[t] = t + 1;
}
// Each thread sums what every thread of the team wrote before.
void gather(const int64_t* slots, int64_t* sums) {
  int64_t s = 0;
  for (int i = 0; i < omp_get_num_threads(); ++i) s += slots[i];
  sums[omp_get_thread_num()] = s;
}
void team_size(int64_t* out) { out[omp_get_thread_num()] = omp_get_num_threads(); }
}
"""


def test_team_calls_run_in_one_team_with_a_barrier_between(tmp_path):
    """Consecutive team calls run on every thread of one OpenMP team, each after the
    last one finished on all threads; a plain call between them runs outside it."""
    from passes.native import load_library
    from passes.native_calls import function_address

    lib = load_library(TEAM_SOURCE, "team_test", tmp_path)
    slots, sums = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    sizes = torch.zeros(3, dtype=torch.int64)

    def step():
        _declare(
            [
                NativeCall(function_address(lib.mark), (slots,), "mark", 2, None),
                NativeCall(function_address(lib.gather), (slots, sums), "gather", 2, None),
            ]
        )
        _declare(NativeCall(function_address(lib.team_size), (sizes[2:],), "team_size", 0, None))
        _declare(NativeCall(function_address(lib.team_size), (sizes[:2],), "team_size", 2, None))
        return sums

    _, graph = cpu_graph.capture(step, tmp_path)
    assert graph.replay().tolist() == [3, 3]  # thread 0 waited for thread 1's late write
    assert sizes.tolist() == [2, 2, 1]


def test_cpu_graphs_switch_off(tiny_llama, tmp_path):
    llm = LLM(
        str(tiny_llama[0]),
        compilation_config={"cache_dir": str(tmp_path), "cpu_graphs": False},
    )
    _tokens(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.llm_engine.runner.cpu_graphs == {}
    assert compile_cache_root(llm.engine_config) == tmp_path


def test_cpp_wrapper_turns_cpu_graphs_off():
    """Inductor's C++ wrapper calls its kernels from C, where no capture sees them: a graph
    would replay the native ops alone, so the combination is switched off, not attempted (the
    capture happened to refuse it for an unrelated `detach_`; docs/kernel-choices.md, Inductor's
    C++ wrapper)."""
    from compilecore.config import CompilationConfig

    assert CompilationConfig().cpu_graphs
    assert not CompilationConfig(inductor_options={"cpp_wrapper": True}).cpu_graphs
    assert CompilationConfig(inductor_options={"cpp_wrapper": False}).cpu_graphs
    with torch._inductor.config.patch(cpp_wrapper=True):  # set process-wide
        assert not CompilationConfig().cpu_graphs
    assert CompilationConfig().cpu_graphs


def test_pack_parameters_keeps_values_and_identity():
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = list(model.parameters())
    x = torch.randn(3, 512)
    want = model(x)
    moved = pack_parameters(model)
    if moved == 0:
        pytest.skip("this kernel refuses MADV_HUGEPAGE")
    assert list(model.parameters()) == params  # the same Parameter objects
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
    ptrs = sorted(p.data_ptr() for p in params)
    assert ptrs[-1] - ptrs[0] < moved  # one arena
    assert torch.equal(model(x), want)


def test_decode_batches_pad_to_the_next_compile_size(tiny_llama, tmp_path):
    """With compile_sizes=[4], decode batches of 1-3 use the size-4 code padded with
    sequences that write nowhere; their tokens equal an engine without static sizes."""
    from runtime.model_runner import StepPlan, pad_decode_plan

    plan = StepPlan(token_ids=[7], positions=[5], slots=[21], query_starts=[0, 1],
                    seq_lens=[6], block_tables=[[5, 2]], num_decodes=1,
                    logits_rows=[0])  # fmt: skip
    padded = pad_decode_plan(plan, 4)
    assert padded.num_tokens == 4 and padded.num_decodes == 4
    assert padded.slots == [21, -1, -1, -1] and padded.logits_rows == [0, 1, 2, 3]
    assert padded.block_tables[1:] == [[0]] * 3 and padded.seq_lens[1:] == [1] * 3
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = []
    for sizes in ([4], []):
        llm = LLM(str(tiny_llama[0]), compilation_config={
            "cache_dir": str(tmp_path / str(sizes)), "compile_sizes": sizes,
            "cpu_graph_sizes": sizes})  # fmt: skip
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("batch, size", [(3, 3), (6, 6), (12, 12), (23, 24), (40, 40),
                                         (17, None)])  # fmt: skip
def test_decode_batches_replay_graphs_of_the_symbolic_size_code(compiled, batch, size):
    """Decode batches above 1 have no static code, but their products are native calls
    (`compilecore.packed_mm`: our kernel's, or oneDNN's through AOTInductor's C shim).
    Each size up to 16 records a graph, larger ones at 24, 32, ... 64, padded by at most
    1/8 of their rows (17 would pad 7: piece by piece); tokens equal the piece-by-piece run
    of the same engine."""
    from passes.ops import onednn_shim, packed_linear

    if not native_cpu_kernels():
        pytest.skip("no AVX-512: the compiler alone runs batched products (extern GEMM)")
    if not packed_linear.uses_own_kernel(torch.bfloat16) and onednn_shim.shim_call() is None:
        pytest.skip("oneDNN takes bf16 here and this torch has no shim to record it")
    runner = compiled.llm_engine.runner
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT[i % 5 :] + [i] for i in range(batch)]
    runner.cpu_graphs.clear()
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    if size is None:
        assert runner.cpu_graphs == {}
        return
    graph = runner.cpu_graphs[size]
    assert isinstance(graph, cpu_graph.CpuGraph)
    runner.cpu_graphs[size] = None
    want = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert got == want


_BATCH_ONE_LAST = """
import sys
from compilecore import cpu_graph
from runtime import LLM, SamplingParams
from runtime.model_runner import ModelRunner

if sys.argv[3] == "cold-lm-head":  # as before the fix: no logits in warm-up
    warm_up = ModelRunner.warm_up

    def without_logits(self):
        self.model.compute_logits = lambda hidden: None
        try:
            return warm_up(self)
        finally:
            del self.model.compute_logits

    ModelRunner.warm_up = without_logits
llm = LLM(sys.argv[1], dtype="bfloat16", compilation_config={"cache_dir": sys.argv[2]})
short, long = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 8))
prompt = [5, 17, 42, 99, 7, 3, 250, 31, 8]
# Two rows of logits at every step until the first finishes: then the first 1-row LM head
# call is a batch-1 decode, the step that records the graph.
llm.generate([prompt, prompt[2:]], [short, long], use_tqdm=False)
assert isinstance(llm.llm_engine.runner.cpu_graphs[1], cpu_graph.CpuGraph), "no batch-1 graph"
"""


@pytest.mark.parametrize("case", ["default", "cold-lm-head"])
def test_batch_one_after_larger_batches_still_records(tiny_llama, tmp_path, case):
    """The one-row LM head is compiled in warm-up: were its first call the first batch-1
    decode, it would fall inside that step's capture, whose recorder cannot see a module
    created during it. Should a module still be born mid-capture (`cold-lm-head` recreates
    the old warm-up), the failure is transient and the next step records. A fresh process
    (this one has every module loaded already) and a cold cache."""
    res = subprocess.run(
        [sys.executable, "-c", _BATCH_ONE_LAST, str(tiny_llama[0]), str(tmp_path), case],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]


def test_replaced_weights_are_used_by_the_next_decode(tiny_llama, tmp_path):
    """A graph holds raw weight addresses: replacing parameters (a weight reload with
    `load_state_dict(assign=True)`) must re-record it, and the recipe must look the new
    parameters up, or decode would read the old (or freed) weights."""
    llm = LLM(str(tiny_llama[0]), compilation_config={"cache_dir": str(tmp_path)})
    before = _tokens(llm)
    runner = llm.llm_engine.runner
    old_graph = runner.cpu_graphs[1]
    assert isinstance(old_graph, cpu_graph.CpuGraph)
    new = {n: p.detach().flip(0).clone() for n, p in runner.model.named_parameters()}
    runner.model.load_state_dict(new, strict=False, assign=True)
    after = _tokens(llm)
    assert isinstance(runner.cpu_graphs[1], cpu_graph.CpuGraph)
    assert runner.cpu_graphs[1] is not old_graph  # recorded again
    runner.cpu_graphs[1] = None  # piece by piece: the recipe with the new parameters
    assert _tokens(llm) == after != before


def test_every_way_of_editing_weights_reaches_every_graph(tiny_llama, tmp_path):
    """Graphs read weights by address, batched graphs read packed copies of them, the
    batch-1 greedy head reads an int8 screen of its weight: after any edit of the weights
    in place, each must follow (compilecore/weight_watch.py). The oracle is a new engine on
    a checkpoint of the edited weights; the edits alternate between the flipped weights
    and the original ones, so each path is seen to take effect. A write through `.data`
    (torch's alias counts no version) is seen because the watch's parameters share the
    counter with their `.data`; a write torch cannot see (through a numpy view) needs
    `mark_weights_changed`. After `assign`, the new parameters are watched the same way."""
    import shutil

    from safetensors.torch import save_file

    from compilecore.recipe import mark_weights_changed
    from models.loader import iterate_weights

    files = sorted(tiny_llama[0].glob("*.safetensors"))
    flipped = tmp_path / "flipped"
    shutil.copytree(tiny_llama[0], flipped, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.flip(0).contiguous() for n, t in iterate_weights(files)},
              str(flipped / "model.safetensors"))  # fmt: skip
    prompts = [PROMPT, PROMPT[2:], PROMPT[4:]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        batched = llm.generate(prompts, params, use_tqdm=False)  # graph 3, packed copies
        alone = llm.generate(prompts[:1], params, use_tqdm=False)  # graph 1, the screen
        return [o.outputs[0].token_ids for o in [*batched, *alone]]

    config = {"cache_dir": str(tmp_path / "cache")}
    llm = LLM(str(tiny_llama[0]), dtype="bfloat16", compilation_config=config)
    fresh = LLM(str(flipped), dtype="bfloat16", compilation_config=config)
    model = llm.llm_engine.runner.model
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    edited = {n: p.detach().clone() for n, p in fresh.llm_engine.runner.model.named_parameters()}
    want = {"original": tokens(llm), "edited": tokens(fresh)}
    assert want["original"] != want["edited"]
    # The batch of 3's graph where batches record one (native_cpu_kernels), else batch 1's.
    size = 3 if native_cpu_kernels() else 1
    old_graph = llm.llm_engine.runner.cpu_graphs[size]
    assert isinstance(old_graph, cpu_graph.CpuGraph)

    def each(edit):
        def apply(target):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    edit(name, p, target[name])

        return apply

    def numpy_then_mark(target):  # numpy has no bf16: the bits as int16
        bits = lambda x: x.detach().view(torch.int16).numpy()  # noqa: E731
        each(lambda n, p, t: bits(p).__setitem__(..., bits(t)))(target)
        mark_weights_changed()

    edits = {
        "load_weights": lambda target: model.load_weights(
            (n, t.flip(0) if target is edited else t) for n, t in iterate_weights(files)
        ),
        "load_state_dict": lambda target: model.load_state_dict(target, strict=False),
        "copy_": each(lambda n, p, t: p.copy_(t)),
        "arithmetic": each(lambda n, p, t: p.mul_(0).add_(t)),
        ".data =": each(lambda n, p, t: setattr(p, "data", t.clone())),
        ".data.copy_": each(lambda n, p, t: p.data.copy_(t)),
        "load_state_dict(assign=True)": lambda target: model.load_state_dict(
            {n: t.clone() for n, t in target.items()}, strict=False, assign=True
        ),
        ".data.mul_, .data.add_": each(lambda n, p, t: p.data.mul_(0).add_(t)),
        "numpy view + mark_weights_changed": numpy_then_mark,
    }
    for i, (path, edit) in enumerate(edits.items()):
        target = "edited" if i % 2 == 0 else "original"
        if path == ".data =":
            assert tokens(fresh) == want["edited"]  # (marks by load_weights reached it)
            fresh_graph = fresh.llm_engine.runner.cpu_graphs[size]
        edit(edited if target == "edited" else original)
        assert tokens(llm) == want[target], path
        if path == ".data =":  # another engine's watch sees its own weights unchanged
            assert tokens(fresh) == want["edited"]
            assert fresh.llm_engine.runner.cpu_graphs[size] is fresh_graph
    assert llm.llm_engine.runner.cpu_graphs[size] is not old_graph  # recorded again
    llm.llm_engine.runner.cpu_graphs.update(dict.fromkeys(llm.llm_engine.runner.cpu_graphs))
    assert tokens(llm) == want[target]  # piece by piece from now


def test_two_engines_stepping_on_two_threads_each_get_their_solo_results(compiled, tmp_path):
    """A greedy engine (its batch-1 head screened for an argmax) and a sampled one with
    logprobs and a seed, replaying their CPU graphs on two threads at once, give exactly
    what each gives alone: the argmax-only flag is each model's own argument to the head,
    not a process-wide switch (with one, the sampled engine's rows read -inf)."""
    other = LLM(
        str(compiled.engine_config.model_config.model),
        dtype="bfloat16",
        compilation_config={"cache_dir": str(tmp_path)},
    )
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=7, logprobs=3, max_tokens=40,
                             ignore_eos=True)  # fmt: skip

    def run(llm: LLM, params: SamplingParams) -> tuple:
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        logprobs = [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs or []]
        return out.token_ids, logprobs

    alone = {"greedy": run(compiled, GREEDY), "sampled": run(other, sampled)}
    assert compiled.llm_engine.runner.cpu_graphs.get(1) is not None
    assert other.llm_engine.runner.cpu_graphs.get(1) is not None
    # Recorded again on the threads, both at once: one capture waits for the other, and
    # the other engine's steps (prefills through the forward context, replays) go on
    # outside it.
    compiled.llm_engine.runner.cpu_graphs.clear()
    other.llm_engine.runner.cpu_graphs.clear()
    start, together = threading.Barrier(2), {}

    def loop(name: str, llm: LLM, params: SamplingParams) -> None:
        start.wait()
        together[name] = [run(llm, params) for _ in range(4)]

    threads = [
        threading.Thread(target=loop, args=("greedy", compiled, GREEDY)),
        threading.Thread(target=loop, args=("sampled", other, sampled)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in alone:
        assert all(got == alone[name] for got in together[name]), name
    assert compiled.llm_engine.runner.cpu_graphs.get(1) is not None
    assert other.llm_engine.runner.cpu_graphs.get(1) is not None


def test_marking_one_models_weights_leaves_other_models_graphs_alone():
    """`load_weights` marks its own model: a second engine loading its checkpoint must not
    make the first record (on a GPU: capture) its graphs again; an unattributed mark
    still reaches every model."""
    from compilecore.recipe import mark_weights_changed
    from compilecore.weight_watch import WeightWatch

    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    watch_first, watch_second = WeightWatch(first), WeightWatch(second)
    mark_weights_changed(second)
    assert not watch_first.check() and watch_second.check()
    assert not watch_second.check()  # seen once
    mark_weights_changed()
    assert watch_first.check() and watch_second.check()


@settings(max_examples=200, deadline=None)
@given(teams=st.lists(st.sampled_from([0, 0, 1, 2, 4]), max_size=40))
def test_regions_cover_the_calls_in_order_one_team_each(teams):
    """The region pass: the calls in order, split into maximal runs of one team size (a
    plain run for team 0), a barrier after each team call but a region's last."""
    regions = form_regions(teams)
    assert [c for r in regions for c in r.calls] == list(range(len(teams)))
    assert all(r.calls and {teams[c] for c in r.calls} == {r.team} for r in regions)
    assert all(a.team != b.team for a, b in zip(regions, regions[1:]))  # maximal runs
    for r in regions:
        assert r.barriers == tuple(bool(r.team) and c != r.calls[-1] for c in r.calls)
    stats = region_stats(regions)
    assert stats["team_calls"] + stats["plain_calls"] == len(teams)
    assert stats["barriers"] == stats["team_calls"] - stats["parallel_regions"]


def test_a_graph_profiles_each_of_its_calls(compiled):
    """`CpuGraph.profile`: every recorded call with its time inside the replay (the
    team's, between the barriers after calls), in the program's order; the replays leave
    the graph's outputs as a replay does."""
    runner = compiled.llm_engine.runner
    runner.cpu_graphs.pop(1, None)  # recorded afresh here, whatever the tests before did
    _tokens(compiled, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    graph = runner.cpu_graphs[1]
    assert isinstance(graph, cpu_graph.CpuGraph)
    want = graph.replay().clone()
    rows = graph.profile(replays=9)
    assert [info for info, _ in rows] == graph.described
    assert all(us >= 0 for _, us in rows) and sum(us for _, us in rows) > 0
    assert torch.equal(graph.replay(), want)
