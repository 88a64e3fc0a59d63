"""Shared helpers for the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from passes import native, prefetch
from passes.huge_pages import huge_page_buffer
from runtime import LLM, SamplingParams

PROMPT_37 = list(range(100, 137))  # a 37-token prompt
RESULTS = Path(__file__).parent / "results"


# vLLM's quickstart sampling, which `--sampled` decodes with in every engine (llama.cpp and
# HF with their top-k and min-p filters off, so all draw from the same nucleus).
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
GREEDY = {"temperature": 0}


def drawn(sampling: dict | None) -> str:
    """How a benchmark's tokens are drawn, for its title."""
    if not sampling:
        return "greedy"
    return f"sampled ({', '.join(f'{k} {v}' for k, v in sampling.items())})"


def decode_once(
    llm: LLM, prompt: list[int], tokens: int, sampling: dict[str, float] | None = None
) -> float:
    """One batch-1 decode of `tokens` tokens (EOS ignored), greedy or with `sampling`'s
    SamplingParams: tokens/s between the first and the last generated token."""
    params = SamplingParams(**(sampling or GREEDY), max_tokens=tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].metrics.decode_tokens_per_s


def decode_speed(
    llm: LLM,
    prompt: list[int],
    tokens: int,
    repeats: int,
    timed: Callable[[Callable[[], float]], float] = lambda run: run(),
    sampling: dict[str, float] | None = None,
) -> float:
    """Median batch-1 decode tokens/s over `repeats` runs, after one warm-up run; `timed`
    runs each measured run (`PairedBandwidth.around`, to pair it with the bandwidth)."""
    run = functools.partial(decode_once, llm, prompt, tokens, sampling)
    run()
    speeds = sorted(timed(run) for _ in range(repeats))
    return speeds[len(speeds) // 2]


def _sum_buffer(nbytes: int, dtype: torch.dtype, device: str, huge: bool) -> torch.Tensor:
    """A buffer of ones (written: an untouched buffer reads the kernel's zero page, not
    DRAM), on CPU in normal or in transparent huge pages."""
    if not huge:
        return torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    return huge_page_buffer(nbytes)[0].view(dtype).fill_(1)


@functools.cache
def _memory_read() -> ctypes.CDLL | None:
    """memory_read.cpp built for this CPU, or None (torch's sum alone then)."""
    source = Path(__file__).with_name("memory_read.cpp")
    try:
        lib = native.load_library(source.read_text(), source.stem, native.cache_root())
    except (OSError, native.KernelBuildError):
        return None
    if not lib.memory_read_available():
        return None
    lib.memory_read_sum.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.memory_read_sum.restype = ctypes.c_float
    return lib


def sums(buffer: torch.Tensor) -> list[Callable[[], object]]:
    """The reads of all of `buffer` this machine offers: torch's sum, and on a CPU with
    AVX-512 a native loop without and with a software prefetch (memory_read.cpp): the
    engine's products prefetch on Intel CPUs, so a ceiling must read that way too."""
    reads: list[Callable[[], object]] = [buffer.sum]
    lib = _memory_read() if buffer.device.type == "cpu" else None
    if lib is not None and buffer.dtype == torch.float32 and buffer.is_contiguous():
        args = (buffer.data_ptr(), buffer.numel(), torch.get_num_threads())
        ahead = (0, prefetch.WEIGHT_PREFETCH)
        reads += [functools.partial(lib.memory_read_sum, *args, a) for a in ahead]
    return reads


def fastest_sum(buffer: torch.Tensor) -> Callable[[], object]:
    """Of `sums(buffer)`, the one whose best of three runs was fastest."""

    def best(read: Callable[[], object]) -> float:
        read()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            read()
            times.append(time.perf_counter() - start)
        return min(times)

    return min(sums(buffer), key=best)


def read_bandwidth(device: str = "cpu", nbytes: int = 512 << 20, repeats: int = 7) -> float:
    """Best GB/s of a sum over a buffer larger than the last-level cache, in bf16 and in
    fp32, and on CPU in normal and in huge pages, by torch and by a native loop with and
    without prefetching (`sums`): the weights sit in huge pages (runtime/huge_pages.py),
    which read up to ~35% faster here, so a ceiling measured in normal pages only is not
    one (docs/kernel-choices.md, Huge pages). The best, not the median: a ceiling is what the memory
    delivered at its fastest; on a shared machine take the largest of several calls
    spread over the run."""
    best = 0.0
    pages = (False, True) if device == "cpu" else (False,)
    for dtype, huge in itertools.product((torch.bfloat16, torch.float32), pages):
        x = _sum_buffer(nbytes, dtype, device, huge)
        for read in sums(x):
            read()
            for _ in range(repeats):
                if device != "cpu":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                read()
                if device != "cpu":
                    torch.cuda.synchronize()
                best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
        del x
    return best


class PairedBandwidth:
    """The read bandwidth right around one timed run. The memory of these shared machines
    swings by up to 2x within a minute (docs/performance.md), so a run's GB/s over the best
    sum of the whole run says more about the minute it ran in than about the engine; here
    each run is compared with sums over a written huge-page buffer taken just before and
    just after it (the fastest of `sums`)."""

    def __init__(self, nbytes: int = 512 << 20) -> None:
        self.nbytes = nbytes
        self.buffer = _sum_buffer(nbytes, torch.float32, "cpu", True)
        self.read = fastest_sum(self.buffer)

    def measure(self, seconds: float = 0.1) -> float:
        """Mean GB/s of sums over the buffer for at least `seconds` (at least three)."""
        start, count = time.perf_counter(), 0
        while count < 3 or time.perf_counter() - start < seconds:
            self.read()
            count += 1
        return count * self.nbytes / (time.perf_counter() - start) / 1e9

    def around(self, run: Callable[[], float], bytes_per_unit: float, shares: list[float]) -> float:
        """`run()`'s units/s; appends its GB/s as a share of the mean of the sums before
        and after it to `shares`."""
        before = self.measure()
        speed = run()
        after = self.measure()
        shares.append(speed * bytes_per_unit / 1e9 / ((before + after) / 2))
        return speed


class WeightsRead:
    """The memory's own batch-1 decode: one sum (the fastest of `sums`) over a written
    huge-page buffer of the weights' size per token, timed like a decode. What an engine
    that did nothing but stream its weights once a token would reach in the same minutes:
    the best-of-run ceiling is a 10 ms burst and a run's GB/s moves with the minute it
    caught (docs/performance.md), so this row says what share of that ceiling a run of the
    same length can reach."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = _sum_buffer(max(nbytes, 1 << 12), torch.float32, "cpu", True)
        self.read = fastest_sum(self.buffer)

    def decode(self, tokens: int) -> float:
        """Reads/s between the first and the last of `tokens` reads, (N - 1) / (t_N - t_1)."""
        self.read()
        start = time.perf_counter()
        for _ in range(max(tokens, 2) - 1):
            self.read()
        return (max(tokens, 2) - 1) / (time.perf_counter() - start)


def copy_bandwidth(device: str = "cpu", nbytes: int = 512 << 20) -> float:
    """GB/s read by a large copy of written memory (bytes read; as many are written)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.zeros_like(src)
    for _ in range(2):
        dst.copy_(src)
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    if device != "cpu":
        torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def weight_bytes(llm: LLM) -> int:
    """The weight bytes a batch-1 decode step reads: every weight, of the token embedding
    one row (all of it where the head reads the same tensor). Counting the whole table
    had the 1.7B Q4_K_M file read 1158.6 MB a token where its layers and head hold 1053."""
    model = llm.llm_engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    table = list(embed.parameters()) if embed is not None else []
    head = getattr(model, "lm_head", None)
    read_by_head = {p.data_ptr() for p in head.parameters()} if head is not None else set()
    if not table or any(p.data_ptr() in read_by_head for p in table):
        return total
    nbytes = sum(p.numel() * p.element_size() for p in table)
    return total - nbytes + nbytes // table[0].shape[0]


def bytes_read_per_token(llm: LLM, sampling: dict[str, float] | None) -> int:
    """The weight bytes a batch-1 decode step of `llm` reads (asked after such steps ran):
    all weights (a quantized head's blocks included), except that a greedy step
    (`sampling` None: no logprobs either) reads a 16-bit LM head through its int8 screen
    (passes/ops/gemv.py) where it has one."""
    from passes.ops import gemv

    head = getattr(llm.llm_engine.model.lm_head, "weight", None)  # None: quantized
    screen = gemv.screen_bytes(head) if sampling is None and head is not None else None
    if screen is None:
        return weight_bytes(llm)
    return weight_bytes(llm) - head.numel() * head.element_size() + screen


def bf16_default(model: str | None) -> dict:
    """For the benchmarks that compare 16-bit engines (llama.cpp's BF16 GGUF, HF): the
    default model's dequantized bf16 copy, not its Q4_1 file (bench_gguf.py runs that)."""
    return {"load_format": "safetensors"} if model is None else {}


def compare(
    variants: dict[str, dict], measure: Callable[[LLM], float], rounds: int = 1, **llm_kwargs
) -> dict:
    """Build an LLM per variant (one process, all alive), then measure them in `rounds`
    rounds, alternating their order each round: the machine's speed moves within minutes,
    so only ratios within one round compare. tok_s is the median over rounds."""
    llms, results = {}, {}
    for name, kwargs in variants.items():
        start = time.perf_counter()
        llms[name] = LLM(**llm_kwargs, **kwargs)
        results[name] = {"startup_s": time.perf_counter() - start, "rounds": []}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name]["rounds"].append(measure(llms[name]))
            print(name, f"round {r}: {results[name]['rounds'][-1]:.1f} tok/s", flush=True)
    for r in results.values():
        r["tok_s"] = statistics.median(r["rounds"])
    del llms
    gc.collect()
    return results


def decode_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every batch-1 decode comparison takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="variants measured alternately")
    return parser


def compare_decode(args: argparse.Namespace, variants: dict[str, dict]) -> dict:
    """Batch-1 decode of the 37-token prompt under each variant, in one process."""
    return compare(
        variants,
        lambda llm: decode_speed(llm, PROMPT_37, args.tokens, args.repeats),
        rounds=args.rounds,
        model=args.model,
        dtype=args.dtype,
        max_model_len=1024,
        kv_cache_memory=64 << 20,
        **bf16_default(args.model),
    )


def print_table(results: dict, title: str, baseline: str) -> None:
    """Median tok/s over rounds, and each variant's ratio to the baseline: the median of
    the per-round ratios with their range."""
    base = results[baseline]["rounds"]
    print(f"\n{title} ({torch.get_num_threads()} threads, {len(base)} rounds)")
    print(f"| variant | tok/s | vs {baseline} (range) | start-up s |\n|---|---|---|---|")
    for name, r in results.items():
        ratios = [a / b for a, b in zip(r["rounds"], base)]
        span = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"| {name} | {r['tok_s']:.1f} | {span} | {r['startup_s']:.1f} |")


def _cpu_model() -> str | None:
    """The CPU's model name: machines of one kind here have been an AMD EPYC one session
    and an AMX Xeon the next, which moves every figure (docs/performance.md)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)


# The /proc/cpuinfo flags that choose our kernels' paths, and the names results print.
_ISA_FLAGS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512", "avx512_vnni": "VNNI",
              "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX"}  # fmt: skip


def cpu_features() -> list[str]:
    """The instruction sets our kernels choose by, as this CPU lists them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.split(":", 1)[-1].split())
    return [name for flag, name in _ISA_FLAGS.items() if flag in flags]


def machine() -> dict:
    amx = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    script = Path(sys.argv[0])
    if script.is_absolute() and script.is_relative_to(Path.cwd()):
        script = script.relative_to(Path.cwd())
    return {
        "command": " ".join(["python", str(script), *sys.argv[1:]]),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_features": cpu_features(),
        "amx": bool(amx()) if amx is not None else None,
        # Our batch-1 loops prefetch their weights on Intel only (docs/kernel-choices.md, Prefetch).
        "weight_prefetch_bytes": prefetch.weight_prefetch_bytes(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def save_results(
    name: str,
    rows: list[dict],
    columns: list[str],
    title: str,
    out_dir: Path = RESULTS,
    chart_key: str | None = None,
) -> Path:
    """JSON + a markdown table (+ a PNG bar chart when matplotlib is installed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"title": title, "machine": machine(), "rows": rows}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2))
    lines = [f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [
            f"{row.get(c):.2f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
            for c in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    if chart_key:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no chart (pip install matplotlib)")
        else:
            fig, ax = plt.subplots(figsize=(7, 3))
            ax.barh([r[columns[0]] for r in rows], [r.get(chart_key) or 0 for r in rows])
            ax.set_xlabel(chart_key)
            ax.set_title(title)
            fig.tight_layout()
            fig.savefig(out_dir / f"{name}.png")
    print("\n".join(lines))
    return out_dir / f"{name}.json"
