"""The device check: everything the GPU path must prove on its first device run, as one
script that finishes in minutes.

    python benchmarks/gpu_check.py OUT            # on a CUDA machine (benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py OUT --dry-run  # the same steps on CPU with tiny models (CI)

Steps, in order: greedy tokens of a small model equal on CPU (eager) and on the device
(compiled); the default model's bf16 greedy tokens on the device equal to CPU eager's up
to each sequence's first near-tie; seeded temperature sampling on the device; compiled
with graphs (full and piecewise CUDA graphs; CPU graphs in a dry run) against eager at
batch 1 (target >= 2x on a GPU; graphs must have replayed); a 300-token prompt in chunks
of 64 with graphs equal to eager; its decode with 4 KV splits forced equal to the
default's; batch-1 decode of a 1B-class Llama with random weights (default, async
scheduling, piecewise) as bytes read a second over the part's nominal peak (target >= 45%)
and over what a sum reads, where its steps' host time and device time go (graph replay back
to back, kernel sum and count); decode attention at 16, 64 and 128 keys a loop trip; the
split-K GEMV against cuBLAS (tiles, then decode with it on and off); the
quantized products' Triton kernel against dequantize +
GEMM; each fusion pass on (and verified) against off; tensor parallelism 2 against 1 when
two devices exist; the GPU-marked tests. Writes OUT/gpu_check.json and OUT/gpu_check.md (each step's
seconds; a failed step keeps what it measured) and exits 1 naming every failed step (2
without a device). The check's engines capture sizes 1, 2, 4, 8 only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_speed, weight_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 6, 7, 8, 9, 10], [42, 17, 3], [100 + i for i in range(30)]]
# The check's engines capture a few sizes only: the default list's ~35 sizes x 33 pieces of
# the 1B model were most of the check's estimated minutes (issue 42).
CAPTURE_SIZES = [1, 2, 4, 8]
LONG_PROMPT = [3 + (i * 37) % 500 for i in range(300)]  # in 5 chunks of 64


class StepFailed(AssertionError):
    """A step's check failed; `result` keeps what it measured for the report."""

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result or {}


@dataclass
class Check:
    device: str
    dry_run: bool
    folder: Path  # the checkpoints
    out: Path
    llms: dict[str, object] = field(default_factory=dict)

    def model(self, name: str) -> str:
        """A random-weight checkpoint: `small` (2 layers) or `big` (1B-class; tiny in a
        dry run), built once."""
        path = self.folder / name
        if not path.exists():
            build_checkpoint(path, big=name == "big" and not self.dry_run, device=self.device)
        return str(path)

    def llm(self, key: str, model: str | None = "small", **kwargs):
        """An engine on `model` ("small", "big", a path, or None: the default model)."""
        from runtime import LLM

        if key not in self.llms:
            kwargs.setdefault("device", self.device)
            if kwargs["device"] == "cuda":  # several engines share the device here
                kwargs.setdefault("kv_cache_memory", 512 << 20)
                if not kwargs.get("enforce_eager"):  # each size is a capture of every piece
                    cc = kwargs.setdefault("compilation_config", {})
                    cc.setdefault("cudagraph_capture_sizes", CAPTURE_SIZES)
            if model in ("small", "big"):
                model = self.model(model)
            kwargs.setdefault("max_model_len", 1024)
            self.llms[key] = LLM(model, **kwargs)
        return self.llms[key]

    def drop(self) -> None:
        for llm in self.llms.values():
            llm.shutdown()
        self.llms.clear()
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def build_checkpoint(folder: Path, big: bool, device: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    sizes = (
        dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8)
        if big
        else dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    )  # fmt: skip
    config = LlamaConfig(**sizes, max_position_embeddings=4096, tie_word_embeddings=big)
    torch.manual_seed(0)
    with torch.device(device if big else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if big else torch.float32)
    model.save_pretrained(str(folder))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, sizes["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(folder))


def greedy(llm, tokens: int = 16) -> list[list[int]]:
    from runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def long_greedy(llm, tokens: int = 16) -> list[int]:
    """Greedy tokens after LONG_PROMPT."""
    from runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return llm.generate([LONG_PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def gpu_test_files() -> list[str]:
    """The test files with GPU-marked tests: collecting the others (and importing what
    they import) would spend the device's minutes on nothing."""
    files = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(p.relative_to(ROOT)) for p in files if "mark.gpu" in p.read_text()]


def step_gpu_tests(check: Check) -> dict:
    # A dry run checks the step's plumbing on one file: CI collects every file anyway, and
    # collecting them all again here took ~15 s of the suite's 20 minutes.
    where = ["tests/test_cuda_graphs.py"] if check.dry_run else gpu_test_files()
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *where],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (check.out / "gpu_tests.log").write_text(res.stdout + res.stderr)
    lines = res.stdout.strip().splitlines() or ["(no output)"]
    # The failing tests by name (and their errors), so the report says what broke.
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))][:8]
    if res.returncode not in (0, 5):  # 5: nothing collected
        raise StepFailed(f"pytest -m gpu: {lines[-1]}", {"failed": failed})
    return {"summary": lines[-1]}


def step_greedy_cpu_vs_device(check: Check) -> dict:
    want = greedy(check.llm("cpu eager", device="cpu", enforce_eager=True))
    got = greedy(check.llm("device"))
    if got != want:
        raise StepFailed(f"greedy tokens differ: device {got} vs CPU {want}")
    return {"prompts": len(PROMPTS), "tokens_each": len(want[0])}


def step_default_model_bf16(check: Check) -> dict:
    """The default model in bf16 (a dry run: the small model), greedy on the device against
    the same bf16 weights eager on CPU, each sequence compared up to its first near-tie
    (CPU's top two within 0.05 nats: bf16's own noise can swap those)."""
    from runtime import SamplingParams

    model = None if not check.dry_run else check.model("small")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    prompts = PROMPTS if check.dry_run else texts  # the small model's vocabulary is t3, t4...
    cpu = check.llm("cpu bf16", model=model, device="cpu", dtype="bfloat16", enforce_eager=True)
    want = cpu.generate(prompts, params, use_tqdm=False)
    got = check.llm("device bf16", model=model, dtype="bfloat16").generate(
        prompts, params, use_tqdm=False
    )
    compared = 0
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)):
            top = sorted((lp.logprob for lp in w.logprobs[i].values()), reverse=True)
            if len(top) > 1 and top[0] - top[1] < 0.05:
                break
            if a != b:
                raise StepFailed(f"bf16 greedy token {i} of {w.text!r}: device {b}, CPU {a}")
            compared += 1
    # The dry run's random 2-layer model ties often; the default model must show more.
    if compared < (1 if check.dry_run else len(prompts) * 4):
        raise StepFailed(f"only {compared} tokens before near-ties: too little was checked")
    return {"prompts": len(prompts), "tokens_compared": compared}


def step_temperature_sampling(check: Check) -> dict:
    """Seeded samples repeat, differ by seed, and are the same with async scheduling
    (drawn on the device, the next step launched before they are read)."""
    from runtime import SamplingParams

    def sample(seed: int, llm) -> list[list[int]]:
        params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    llm = check.llm("device")
    first, again, other = sample(7, llm), sample(7, llm), sample(8, llm)
    if first != again:
        raise StepFailed("the same seed gave different samples")
    if first == other:
        raise StepFailed("two seeds gave the same samples")
    if sample(7, check.llm("device async", async_scheduling=True)) != first:
        raise StepFailed("async scheduling's seeded samples differ from the sync engine's")
    return {"samples": sum(len(t) for t in first)}


def _replays(device: str) -> int:
    """Graph replays so far: CUDA graph pieces, or whole recorded CPU steps."""
    from compilecore.counters import compilation_counter as c

    return c.num_cudagraph_replays if device == "cuda" else c.num_cpu_graph_replays


def _full_replays() -> int:
    from compilecore.counters import compilation_counter as c

    return c.num_full_cudagraph_replays


def step_graphs_vs_eager(check: Check) -> dict:
    """Batch-1 decode: eager, the default graphs (full decode graphs on a GPU) and, on a
    GPU, piecewise graphs alone: the numbers that choose `cudagraph_mode`'s default."""
    prompt, tokens = PROMPTS[2], 64
    eager = decode_speed(check.llm("device eager", enforce_eager=True), prompt, tokens, 3)
    before, full_before = _replays(check.device), _full_replays()
    graphs = decode_speed(check.llm("device"), prompt, tokens, 3)
    replays = _replays(check.device) - before
    full = _full_replays() - full_before
    result = {"eager_tok_s": eager, "graphs_tok_s": graphs, "ratio": graphs / eager,
              "target": 2.0, "replays": replays, "full_replays": full}  # fmt: skip
    if not check.dry_run:
        pieces = check.llm("device piecewise", compilation_config={"cudagraph_mode": "PIECEWISE"})
        result["piecewise_tok_s"] = decode_speed(pieces, prompt, tokens, 3)
        result["full_over_piecewise"] = graphs / result["piecewise_tok_s"]
        if full == 0:
            raise StepFailed("no full decode graph replayed (cudagraph_mode default)", result)
    if replays + full == 0:  # a speed without replays measures something else
        raise StepFailed(f"no graph replayed in 4 x {tokens} decode steps", result)
    if not check.dry_run and result["ratio"] < 2.0:
        raise StepFailed(f"graphs {result['ratio']:.2f}x eager at batch 1 (target 2x)", result)
    return result


def step_chunked_prefill(check: Check) -> dict:
    """A 300-token prompt prefilled in chunks of 64 with graphs on, its greedy tokens equal
    to eager's in one chunk: the staging buffers are rewritten between chunk steps that do
    not sample (issue 42 item 1's race), and decode steps after it replay graphs."""
    want = long_greedy(check.llm("device eager", enforce_eager=True))
    before = _replays(check.device) + _full_replays()
    got = long_greedy(check.llm("device chunked", max_num_batched_tokens=64))
    replays = _replays(check.device) + _full_replays() - before
    if got != want:
        raise StepFailed(f"chunked prefill with graphs: {got} vs eager {want}")
    if replays == 0:
        raise StepFailed("no graph replayed after the chunked prefill")
    return {"prompt": len(LONG_PROMPT), "chunk": 64, "tokens": len(got), "replays": replays}


def step_split_kv(check: Check) -> dict:
    """Decode over the 300-token context with the KV walk forced into 4 splits (the split
    and merge kernels, which short contexts never reach), graphs on: tokens equal to the
    default choice's."""
    if check.dry_run:  # the CPU backend has no split; tests/test_triton_attention.py
        return {"skipped": "the CPU attention backend has no split-KV (interpreter-tested)"}
    want = long_greedy(check.llm("device"))
    got = long_greedy(check.llm("device split 4", attention_num_splits=4))
    if got != want:
        raise StepFailed(f"4 KV splits: {got} vs the default's {want}")
    return {"splits": 4, "context": len(LONG_PROMPT), "tokens": len(got)}


def step_times(llm, prompt: list[int], steps: int) -> dict:
    """Milliseconds a decode step spends, per step, over one greedy request of `steps`
    tokens: the whole engine step; the model call (on a GPU the host's launches and input
    copies: nothing there waits for the device); the sampler (where the host waits for the
    logits); the rest (scheduler, detokenizer, Python between them)."""
    from runtime import SamplingParams

    engine, spent = llm.llm_engine, {"model_call": 0.0, "sampler": 0.0}

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return call

    class TimedSampler:  # the host sampler and async scheduling's draw on the device
        def __init__(self, sampler):
            self.draw = timed("sampler", sampler)
            self.device_tokens = timed("sampler", sampler.device_tokens)
            self.seed_request = sampler.seed_request  # when a request arrives: not a step's

        def __call__(self, *args):
            return self.draw(*args)

    sampler = engine.sampler
    engine.executor.execute = timed("model_call", engine.executor.execute)
    engine.sampler = TimedSampler(sampler)
    try:
        start = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        total = time.perf_counter() - start
    finally:
        del engine.executor.execute  # the instance attribute that shadowed the method
        engine.sampler = sampler
    times = {"step": total, **spent, "other": total - sum(spent.values())}
    return {name: round(1e3 * t / steps, 3) for name, t in times.items()}


def kernel_times(llm, prompt: list[int], steps: int) -> dict:
    """Where a decode step's device time goes: microseconds per step of the kernels that
    took most (torch.profiler over one greedy request of `steps` tokens), and their sum."""
    from torch.profiler import ProfilerActivity, profile

    from runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / steps
    launches = sum(e.count for e in events) / steps
    top = {e.key[:70]: round(e.self_device_time_total / steps, 1) for e in events[:8]}
    return {"device_us_per_step": round(total, 1), "kernels_per_step": round(launches, 1),
            "top_us_per_step": top}  # fmt: skip


# Nominal memory bandwidth (TB/s) by the device name's words, most specific first: what
# a batch-1 decode figure is a fraction of (the vendors' data sheets).
NOMINAL_TB_S = (
    ("GH200", "GH200 (HBM3)", 4.0), ("H200", "H200", 4.8), ("H100 NVL", "H100 NVL", 3.9),
    ("H100 PCIe", "H100 PCIe", 2.0), ("H100", "H100 SXM", 3.35), ("H800", "H800 SXM", 3.35),
    ("A100-SXM4-80GB", "A100 SXM 80GB", 2.039), ("A100 80GB PCIe", "A100 PCIe 80GB", 1.935),
    ("A100", "A100 40GB", 1.555), ("L40S", "L40S", 0.864), ("L4", "L4", 0.3),
)  # fmt: skip
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of the parts above, from their data
# sheets: the denominator of prefill's model FLOPs utilization.
NOMINAL_BF16_TFLOPS = {
    "GH200 (HBM3)": 989, "H200": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100 SXM": 989,
    "H800 SXM": 989, "A100 SXM 80GB": 312, "A100 PCIe 80GB": 312, "A100 40GB": 312,
    "L40S": 362, "L4": 121,
}  # fmt: skip
# Batch-1 decode of the 1B-class bf16 model, as a fraction of the nominal peak (issue 57).
DECODE_TARGET = 0.45


def nominal_bandwidth(name: str) -> tuple[str, float] | None:
    """(part, nominal TB/s) for a CUDA device name, None for a part not in the table."""
    return next(((part, tb) for key, part, tb in NOMINAL_TB_S if key in name), None)


def read_bandwidth(device: str, nbytes: int) -> float:
    """GB/s a sum reads from `nbytes` of written memory (>= 4 GiB on a GPU: far past
    its caches). A copy's rate counts the bytes read once, but it moves twice as many."""
    x = torch.ones(nbytes // 4, device=device)
    x.sum()
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        x.sum()
    if device != "cpu":
        torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def replay_us(llm, rounds: int = 50) -> float | None:
    """Microseconds a batch-1 full decode graph takes replayed back to back (the step's
    device time with no host in the way); None without one. Replays the last step's
    inputs: its request has finished, so the KV it rewrites is nobody's."""
    graph = llm.llm_engine.runner.full_graphs.get(1)
    if graph is None:
        return None
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        graph.replay()
    torch.cuda.synchronize()
    return round(1e6 * (time.perf_counter() - start) / rounds, 1)


# A common chat setting (Llama 3's generation config, with a top-k): batch-1 decode with it
# beside greedy shows what drawing the tokens costs.
SAMPLED = {"temperature": 0.6, "top_p": 0.9, "top_k": 50}


def step_decode_bandwidth(check: Check) -> dict:
    check.drop()  # the 1B model wants the memory
    cuda = check.device == "cuda"
    read = read_bandwidth(check.device, (4 << 30) if cuda else 256 << 20)
    part = nominal_bandwidth(torch.cuda.get_device_name()) if cuda else None
    # A dry run's "big" model is the small one's twin in its dtype: its compile then hits
    # the Inductor cache the small one filled (~10 s of the suite).
    dtype = {} if check.dry_run else {"dtype": "bfloat16"}
    result: dict = {"read_GB_s": read, "part": part and part[0], "nominal_TB_s": part and part[1],
                    "target_of_peak": DECODE_TARGET}  # fmt: skip
    # The default mode (full decode graphs on a GPU), async scheduling, then piecewise
    # graphs alone.
    modes = ["default", "async"] + ([] if check.dry_run else ["PIECEWISE"])
    for mode in modes:
        kwargs = {"async_scheduling": True} if mode == "async" else {}
        if mode == "PIECEWISE":
            kwargs = {"compilation_config": {"cudagraph_mode": mode}}
        llm = check.llm(f"big {mode}", model="big", **dtype, **kwargs)
        speed = decode_speed(llm, PROMPTS[2], 128 if not check.dry_run else 32, 3)
        gb_s = weight_bytes(llm) * speed / 1e9
        steps = 64 if not check.dry_run else 16
        row = {"tok_s": speed, "GB_s": gb_s, "of_read": gb_s / read,
               "of_peak": part and gb_s / 1e3 / part[1],
               "ms_per_step": step_times(llm, PROMPTS[1], steps)}  # fmt: skip
        if cuda:
            row["replay_us"] = replay_us(llm)
            row["kernels"] = kernel_times(llm, PROMPTS[1], 32)
        if mode != "PIECEWISE":  # drawn in the full graph (runtime/sample_kernel.py)
            sampled = decode_speed(llm, PROMPTS[2], 128 if not check.dry_run else 32, 3,
                                   sampling=SAMPLED)  # fmt: skip
            row["sampled_tok_s"] = sampled
            row["sampled_of_peak"] = part and weight_bytes(llm) * sampled / 1e12 / part[1]
        result[mode] = row
        check.drop()
    share = result["default"]["of_peak"]
    if share is not None and share < DECODE_TARGET:
        raise StepFailed(f"batch-1 decode at {share:.0%} of the {part[0]}'s {part[1]} TB/s "
                         f"(target {DECODE_TARGET:.0%})", result)  # fmt: skip
    return result


# Decode batches for the throughput curve (each captured whole), and the tokens a request
# decodes in a measured round.
BATCHES = (1, 4, 16, 64)
_fresh = iter(range(10**9))  # each round's prompts new: no prefix-cache hit


def _batch_round(llm, batch: int, tokens: int, sampling: dict | None) -> tuple[float, int]:
    """One round of `batch` requests, each a 32-token prompt of its own: tokens a second
    over the decode phase (first token of any to the last one's end), and their count."""
    from runtime import SamplingParams

    params = SamplingParams(**(sampling or {"temperature": 0}), max_tokens=tokens,
                            ignore_eos=True)  # fmt: skip
    prompts = _fresh_prompts(batch, 32)
    metrics = [o.metrics for o in llm.generate(prompts, params, use_tqdm=False)]
    elapsed = max(m.finished_time for m in metrics) - min(m.first_token_time for m in metrics)
    decoded = sum(m.num_generated_tokens - 1 for m in metrics)
    return decoded / elapsed, decoded


def step_batch_curve(check: Check) -> dict:
    """Decode throughput by batch on the 1B-class model with full decode graphs, greedy
    and sampled (`SAMPLED`): tokens a second, and the bytes a step reads (every weight
    once, each sequence's KV so far) a second as a fraction of the part's nominal peak."""
    check.drop()
    cuda = check.device == "cuda"
    part = nominal_bandwidth(torch.cuda.get_device_name()) if cuda else None
    batches = BATCHES if not check.dry_run else BATCHES[:2]
    tokens = 128 if not check.dry_run else 16
    dtype = {} if check.dry_run else {"dtype": "bfloat16"}
    llm = check.llm("big batches", model="big", max_num_seqs=max(batches), **dtype,
                    compilation_config={"cudagraph_capture_sizes": list(batches)})  # fmt: skip
    kv_per_token = _kv_bytes_per_token(llm)
    weights = weight_bytes(llm)
    rows: dict = {}
    for batch in batches:
        for name, sampling in (("greedy", None), ("sampled", SAMPLED)):
            _batch_round(llm, batch, tokens, sampling)  # warm: the first round of a size
            tok_s, decoded = _batch_round(llm, batch, tokens, sampling)
            step_bytes = weights + batch * (32 + tokens / 2) * kv_per_token
            gb_s = step_bytes * tok_s / batch / 1e9
            rows[f"{name} x{batch}"] = {"tok_s": tok_s, "tokens": decoded, "GB_s": gb_s,
                                        "of_peak": part and gb_s / 1e3 / part[1]}  # fmt: skip
    check.drop()
    return {"part": part and part[0], "nominal_TB_s": part and part[1], "batches": rows}


def _kv_bytes_per_token(llm) -> float:
    """The KV cache's bytes for one token of one sequence (every layer's K and V)."""
    engine = llm.llm_engine
    blocks = engine.scheduler.block_manager
    cache = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
    return cache / (len(blocks.blocks) * blocks.block_size)


def _fresh_prompts(count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens no earlier round used (no prefix-cache hit)."""
    n = next(_fresh)
    return [[3 + n % 491, 3 + r] + [3 + (n + 7 * r + 13 * i) % 499 for i in range(length - 2)]
            for r in range(count)]  # fmt: skip


def step_prefill_and_long_context(check: Check) -> dict:
    """Prefill of 2 x 2048 fresh tokens in one step on the 1B-class model: tokens a second
    and the model FLOPs utilization (2 x the layers' weights a token, attention's 4 x
    layers x hidden x position) over the part's dense bf16 peak; then batch-1 decode at a
    ~3.5k-token context: tokens a second and a step's bytes (weights, that KV) a second
    over the nominal HBM peak."""
    from runtime import SamplingParams

    check.drop()
    cuda = check.device == "cuda"
    part = nominal_bandwidth(torch.cuda.get_device_name()) if cuda else None
    tflops = part and NOMINAL_BF16_TFLOPS.get(part[0])
    prompt, context = (2048, 3500) if not check.dry_run else (128, 300)
    dtype = {} if check.dry_run else {"dtype": "bfloat16"}
    llm = check.llm("big long", model="big", max_model_len=4096,
                    max_num_batched_tokens=2 * prompt, **dtype)  # fmt: skip
    model = llm.llm_engine.model
    config = model.config
    layers = sum(p.numel() for p in model.model.layers.parameters())
    attention = 4 * config.num_hidden_layers * config.hidden_size * prompt / 2
    flops_per_token = 2 * layers + attention
    first = SamplingParams(temperature=0, max_tokens=1)
    for _ in range(2):  # the second round is measured
        metrics = [o.metrics for o in llm.generate(_fresh_prompts(2, prompt), first,
                                                   use_tqdm=False)]  # fmt: skip
    elapsed = max(m.first_token_time for m in metrics) - min(m.arrival_time for m in metrics)
    prefill = 2 * prompt / elapsed
    mfu = tflops and prefill * flops_per_token / (tflops * 1e12)
    kv_per_token = _kv_bytes_per_token(llm)
    tokens = 128 if not check.dry_run else 16
    decode = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for _ in range(2):
        out = llm.generate(_fresh_prompts(1, context), decode, use_tqdm=False)[0]
    tok_s = out.metrics.decode_tokens_per_s
    gb_s = (weight_bytes(llm) + (context + tokens / 2) * kv_per_token) * tok_s / 1e9
    check.drop()
    return {"part": part and part[0], "prefill_tok_s": prefill, "prefill_mfu": mfu,
            "bf16_TFLOPs": tflops, "long_context": context, "long_tok_s": tok_s,
            "long_GB_s": gb_s, "long_of_peak": part and gb_s / 1e3 / part[1]}  # fmt: skip


# Launch tiles the quantized products' step times (block_m, block_n, block_k, num_warps):
# the default first; small N tiles give a decode step more programs, long K steps more
# bytes in flight per program.
# (block_m, block_n, block_k, num_warps, num_stages, split_k): one-row programs for a
# single row, then tiles for `tl.dot` (docs/kernel-choices.md,
# Quantized products on CUDA).
QUANT_TILES = (
    [None]
    + [
        (1, bn, bk, warps, None, split)
        for bn in (8, 16, 32)
        for bk in (256, 512)
        for warps in (2, 4)
        for split in (1, 4)
    ]
    + [(16, bn, bk, 4, None, split) for bn in (16, 32, 64) for bk in (128, 256) for split in (1, 4)]
)


def step_quantized_products(check: Check) -> dict:
    """The quantized products' Triton kernel (`passes/ops/triton_quant.py`) against what
    runs without the pass (Inductor's compiled dequantization, then cuBLAS), bf16, on a
    1.7B-class MLP's 8192 x 2048 blocks and a 2048 x 2048 projection, at 1 and 16 rows:
    device time per call (CUDA graphs of 20 calls), GB/s of blocks read, for each tile in
    QUANT_TILES, results checked against the reference. The numbers that decide whether
    `quantized_linear` goes on by default on CUDA, and with which tile."""
    if check.dry_run:
        return {"skipped": "CUDA only (the kernel is interpreter-tested in the suite)"}
    from passes.ops import quantized
    from passes.ops.triton_quant import Tile, quant_linear_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {}
    for n, k in ((8192, 2048), (2048, 2048)):
        w4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
        s = torch.rand(n, k // 32, device="cuda", generator=g).half() * 0.05
        for name, w, fields in (("q4", w4, (s, -s)), ("q8", w8, (s,))):
            nbytes = sum(t.numel() * t.element_size() for t in (w, *fields))
            ref = quantized.q4_linear_ref if name == "q4" else quantized.q8_linear_ref
            inductor = torch.compile(ref, dynamic=False)
            for rows in (1, 16):
                x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
                want = ref(x, w, *fields).float()
                case = {"inductor_us": _graph_us(functools.partial(inductor, x, w, *fields))}
                for spec in QUANT_TILES:
                    if spec is not None and (spec[0] > rows or 1 == spec[0] < rows):
                        continue
                    tile = None if spec is None else Tile(*spec)
                    label = "default" if spec is None else "x".join(map(str, spec))
                    fn = functools.partial(quant_linear_triton, x, w, fields, tile=tile)
                    try:
                        err = (fn().float() - want).abs().max().item()
                    except Exception as e:  # a tile Triton cannot build: say so, time the rest
                        case[label] = f"{type(e).__name__}: {str(e)[:100]}"
                        continue
                    if err > 2e-2 * max(1.0, want.abs().max().item()):
                        raise StepFailed(f"{name} {n}x{k} {rows} rows {spec}: off by {err}", result)
                    case[label] = _graph_us(fn)
                result[f"{name}_{n}x{k}_{rows}"] = case
                timed = [(v, t) for t, v in case.items() if isinstance(v, float)]
                best = min(((v, t) for v, t in timed if t != "inductor_us"), default=None)
                default = case["default"]
                if best is None or not isinstance(default, float):
                    raise StepFailed(f"{name} {n}x{k} {rows} rows: default tile: {default}", result)
                case.update(best=best[1], best_GB_s=nbytes / best[0] / 1e3,
                            best_vs_inductor=case["inductor_us"] / best[0])  # fmt: skip
                case["default_vs_inductor"] = case["inductor_us"] / default
    return result


def step_quantized_decode(check: Check) -> dict:
    """Batch-1 decode of the 1B-class model quantized at load (`quantization="int8"` and
    `"int4"`), with the quantized-product pass off (Inductor's dequantization + cuBLAS)
    and on (the Triton kernel): tok/s, bytes a token, the first greedy tokens of each
    (equal, or where they part: the same products summed in another order)."""
    if check.dry_run:
        return {"skipped": "CUDA only"}
    check.drop()
    result: dict = {}
    for quant in ("int8", "int4"):
        tokens = {}
        for on in (False, True):
            key = f"{quant} pass {'on' if on else 'off'}"
            cc = {"passes": {"quantized_linear": on}, "cudagraph_capture_sizes": [1, 2, 4]}
            llm = check.llm(f"big {key}", model="big", dtype="bfloat16", quantization=quant,
                            compilation_config=cc)  # fmt: skip
            speed = decode_speed(llm, PROMPTS[2], 128, 3)
            result[key] = {"tok_s": speed, "MB_a_token": weight_bytes(llm) / 1e6}
            tokens[on] = greedy(llm, 8)
            check.drop()
        same = [a == b for a, b in zip(tokens[False], tokens[True])]
        result[quant] = {"on_over_off": result[f"{quant} pass on"]["tok_s"]
                         / result[f"{quant} pass off"]["tok_s"], "prompts_equal": same}  # fmt: skip
    return result


def _graph_us(fn: Callable, calls: int = 20, replays: int = 5) -> float:
    """Device microseconds per call of `fn`, captured `calls` times in one CUDA graph
    (no launch overhead: what a captured decode step pays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


# (batch, context) of the attention step: batch 1 at the decode check's context and long.
ATTENTION_CASES = ((1, 160), (1, 4000), (8, 1000), (32, 1000))


def _decode_case(batch: int, context: int, device: str, block: int = 16):
    """A decode batch on the 1B-class model's attention shape (32 heads, 8 KV heads of
    64, bf16): q, a shuffled paged cache with every sequence at `context`, metadata."""
    from runtime.attention.metadata import AttentionMetadata

    g = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    per_seq = -(-context // block)
    cache = torch.randn(2, batch * per_seq + 1, block, 8, 64, device=device, generator=g)
    table = torch.randperm(batch * per_seq, device=device, generator=g).int().view(batch, -1)
    meta = AttentionMetadata(
        num_actual_tokens=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        block_table=table, max_query_len=1, max_seq_len=4096, num_decodes=batch,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context] * batch,
    )  # fmt: skip
    q = torch.randn(batch, 32 * 64, device=device, generator=g).bfloat16()
    return q, cache.bfloat16(), meta


def step_attention_trips(check: Check) -> dict:
    """Decode attention (the Triton kernel and its merge, split count fixed for a 4096
    context as a full graph's capture fixes it) at 16, 64 and 128 keys a loop trip:
    device us per call (CUDA graphs of 20 calls), each checked against the torch
    backend; the best as KV bytes a second over the part's nominal peak. TRIP_TOKENS is
    the default; this says whether it should be."""
    if check.dry_run:
        return {"skipped": "CUDA only (tests/test_triton_attention.py interprets the kernel)"}
    from runtime.attention.torch_paged import TorchPagedAttentionBackend
    from runtime.attention.triton_paged import TRIP_TOKENS, paged_attention_triton

    part = nominal_bandwidth(torch.cuda.get_device_name())  # (name, TB/s) or None
    result: dict = {"default_trip_tokens": TRIP_TOKENS, "part": part and part[0]}
    for batch, context in ATTENTION_CASES:
        q, cache, meta = _decode_case(batch, context, "cuda")
        layer = type("Layer", (), dict(num_heads=32, num_kv_heads=8, head_size=64,
                                       scale=64**-0.5, kv_cache=cache))()  # fmt: skip
        kv = torch.zeros(batch, 8 * 64, dtype=q.dtype, device="cuda")  # slots -1: unwritten
        ref = torch.empty_like(q)
        TorchPagedAttentionBackend().forward(layer, q, kv, kv, ref, meta)
        case = {}
        for trip in (16, 64, 128):
            out = torch.empty_like(q)
            fn = functools.partial(paged_attention_triton, q, cache, out, meta, 32, 8, 64,
                                   64**-0.5, None, True, trip)  # fmt: skip
            fn()
            err = (out.float() - ref.float()).abs().max().item()
            if err > 2e-2 * max(1.0, ref.float().abs().max().item()):
                raise StepFailed(f"batch {batch} context {context} trip {trip}: off by {err}",
                                 result)  # fmt: skip
            case[f"trip_{trip}_us"] = _graph_us(fn)
        kv_bytes = batch * context * 8 * 64 * 2 * 2  # K and V, bf16
        best = min(v for t, v in case.items() if t.endswith("_us"))
        case["best_KV_TB_s"] = kv_bytes / best / 1e6
        case["best_of_peak"] = part and case["best_KV_TB_s"] / part[1]
        result[f"batch_{batch}_ctx_{context}"] = case
    return result


# The 1B-class model's products (N, K) and split-K tiles (block_n, block_k, num_warps).
GEMV_SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048))
GEMV_TILES = ((16, 256, 4), (32, 128, 4), (8, 512, 4), (16, 512, 8), (64, 128, 4))


def step_splitk_gemv(check: Check) -> dict:
    """The split-K GEMV (`passes/splitk_gemv.py`) against cuBLAS at 1 row, bf16, on the
    1B-class model's products (weight bytes a second, best and cuBLAS's, as a fraction of
    the part's nominal peak too): device us a call of the partials and of partials + sum
    (a consumer would fuse the sum), for each tile at the default split count and twice
    it, checked against the product; then batch-1 decode with the pass on and off (both
    with static-size code for 1 token), tokens compared."""
    if check.dry_run:
        return {"skipped": "CUDA only (tests/test_splitk_gemv.py interprets the kernel)"}
    from passes.ops.gemv_partials import GemvTile, choose_splits, gemv_partials_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    part = nominal_bandwidth(torch.cuda.get_device_name())  # (name, TB/s) or None
    result: dict = {"part": part and part[0], "nominal_TB_s": part and part[1]}
    for n, k in GEMV_SHAPES:
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
        want = x.float() @ w.float().t()
        case = {"cublas_us": _graph_us(functools.partial(torch.mm, x, w.t()))}
        for tile in map(GemvTile._make, GEMV_TILES):
            base = choose_splits(n, k, tile.block_n)
            for splits in sorted({base, min(16, 2 * base)}):
                fn = functools.partial(gemv_partials_triton, x, w, splits, tile)
                err = (fn().sum(0) - want).abs().max().item()
                if err > 1e-2 * max(1.0, want.abs().max().item()):
                    raise StepFailed(f"{n}x{k} {tile} x{splits}: off by {err}", result)
                label = "x".join(map(str, tile)) + f"/{splits}"
                case[label] = _graph_us(fn)
                case[label + "+sum"] = _graph_us(lambda fn=fn: fn().sum(0).bfloat16())
        best = min((v, t) for t, v in case.items() if t != "cublas_us" and "+sum" not in t)
        tb_s, cublas_tb_s = n * k * 2 / best[0] / 1e6, n * k * 2 / case["cublas_us"] / 1e6
        case.update(best=best[1], best_vs_cublas=case["cublas_us"] / best[0], best_TB_s=tb_s,
                    best_of_peak=part and tb_s / part[1],
                    cublas_of_peak=part and cublas_tb_s / part[1])  # fmt: skip
        result[f"{n}x{k}"] = case
    check.drop()
    tokens = {}
    for on in (False, True):
        cc = {"compile_sizes": [1], "passes": {"splitk_gemv": on}}
        llm = check.llm(f"big splitk {on}", model="big", dtype="bfloat16", compilation_config=cc)
        result[f"pass {'on' if on else 'off'} tok_s"] = decode_speed(llm, PROMPTS[2], 128, 3)
        tokens[on] = greedy(llm, 8)
        check.drop()
    result["prompts_equal"] = [a == b for a, b in zip(tokens[False], tokens[True])]
    return result


def step_passes_on_off(check: Check) -> dict:
    want = greedy(check.llm("device"))
    done = {}
    # A dry run checks the step's plumbing with one pass: each costs a cold compile.
    names = ("fuse_add_rms_norm",) if check.dry_run else ("fuse_add_rms_norm", "fuse_qkv_rope")
    for name in names:
        passes = {name: True, "verify": True}
        llm = check.llm(f"device {name}", compilation_config={"passes": passes})
        got = greedy(llm)
        if got != want:
            raise StepFailed(f"{name} on changed greedy tokens: {got} vs {want}")
        done[name] = "equal"
    return done


def step_batch_invariant(check: Check) -> dict:
    """Batch-invariant mode on the device (Triton products with one tile, decode
    attention in one split, short queries as decodes): each of 8 requests (greedy with
    logprobs) gets its tokens alone, in fours and all together; then its batch-1 decode
    speed on the 1B-class model beside the default's."""
    from runtime import SamplingParams

    check.drop()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = check.llm("small invariant", compilation_config={"batch_invariant": True})

    def run(prompts: list) -> list:
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, [sorted((t, p.logprob) for t, p in step.items())
                               for step in o.logprobs]) for o in outs]  # fmt: skip

    prompts = [PROMPTS[i % len(PROMPTS)] + [7 + i] * (1 + 5 * i) for i in range(8)]
    alone = [run([p])[0] for p in prompts]
    fours = run(prompts[:4]) + run(prompts[4:])
    together = run(prompts)
    differ = [i for i in range(8) if not alone[i] == fours[i] == together[i]]
    result: dict = {"requests": 8, "differ": differ}
    check.drop()
    dtype = {} if check.dry_run else {"dtype": "bfloat16"}
    tokens = 32 if check.dry_run else 128
    for mode, cc in (("default", {}), ("invariant", {"batch_invariant": True})):
        big = check.llm(f"big {mode}", model="big", **dtype, compilation_config=cc)
        result[f"{mode}_tok_s"] = decode_speed(big, PROMPTS[2], tokens, 3)
        check.drop()
    result["invariant_over_default"] = result["invariant_tok_s"] / result["default_tok_s"]
    if differ:
        raise StepFailed(f"batch-invariant mode: requests {differ} changed with the batch", result)
    return result


def step_tensor_parallel(check: Check) -> dict:
    if check.dry_run or torch.cuda.device_count() < 2:
        return {"skipped": "fewer than two devices"}
    want = greedy(check.llm("device"))
    got = greedy(check.llm("tp2", tensor_parallel_size=2))
    if got != want:
        raise StepFailed(f"TP=2 greedy tokens differ: {got} vs {want}")
    return {"tp": 2}


# The GPU-marked tests last: the slowest step (2 minutes), and mostly what the steps
# before it check one by one, so a timeout there loses the least.
STEPS: list[tuple[str, Callable[[Check], dict]]] = [
    ("greedy_cpu_vs_device", step_greedy_cpu_vs_device),
    ("default_model_bf16", step_default_model_bf16),
    ("temperature_sampling", step_temperature_sampling),
    ("graphs_vs_eager", step_graphs_vs_eager),
    ("chunked_prefill", step_chunked_prefill),
    ("split_kv", step_split_kv),
    ("decode_bandwidth", step_decode_bandwidth),
    ("batch_curve", step_batch_curve),
    ("prefill_and_long_context", step_prefill_and_long_context),
    ("attention_trips", step_attention_trips),
    ("splitk_gemv", step_splitk_gemv),
    ("quantized_products", step_quantized_products),
    ("quantized_decode", step_quantized_decode),
    ("passes_on_off", step_passes_on_off),
    ("batch_invariant", step_batch_invariant),
    ("tensor_parallel", step_tensor_parallel),
    ("gpu_tests", step_gpu_tests),
]


def write_summary(out: Path, rows: list[dict], device: str) -> None:
    (out / "gpu_check.json").write_text(json.dumps({"device": device, "steps": rows}, indent=2))
    lines = [f"# Device check on {device}", "", "| step | status | seconds | detail |",
             "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        detail = json.dumps(r["detail"], default=str)[:1200].replace("|", "/")
        lines.append(f"| {r['step']} | {r['status']} | {r['seconds']:.1f} | {detail} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--dry-run", action="store_true", help="CPU and tiny models (for CI)")
    parser.add_argument("--steps", nargs="*", default=[n for n, _ in STEPS])
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (--dry-run runs the steps on CPU)", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    name = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        check = Check(device, args.dry_run, Path(tmp) / "models", out)
        check.folder.mkdir()
        for step, fn in STEPS:
            if step not in args.steps:
                continue
            start = time.perf_counter()
            try:
                status, detail = "ok", fn(check)
            except StepFailed as e:  # what it measured stays in the report
                status, detail = "failed", {"failure": str(e), **e.result}
            except Exception as e:  # a crash is a failed step too, with where it happened
                status, detail = "error", "".join(traceback.format_exception(e)[-3:])
            rows.append({"step": step, "status": status, "seconds": time.perf_counter() - start,
                         "detail": detail})  # fmt: skip
            print(f"gpu_check: {step}: {status} ({rows[-1]['seconds']:.1f} s)", flush=True)
            write_summary(out, rows, name)
        check.drop()
    failed = [r["step"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"gpu_check: failed: {', '.join(failed)} (see {out}/gpu_check.md)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
