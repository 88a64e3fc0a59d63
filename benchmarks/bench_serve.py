"""Serving: N concurrent clients (the official `openai` client's async API) against
`compilecore serve`, side by side with llama.cpp's `llama-server --parallel N` (built by
benchmarks/setup_peers.sh) on the same weights, the same workload and the same client.

Workload: a seeded mix of prompt lengths (words) and output lengths (tokens, EOS ignored),
greedy, streamed. Per concurrency level: output tokens/s over the level's wall time, and
time to first token, time per output token and end-to-end latency at p50/p90/p99.

    python benchmarks/bench_serve.py --concurrency 1,4,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
from common import RESULTS, save_results  # noqa: E402

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as",
         "by", "at", "from", "his", "it", "an", "were", "are", "which"]  # fmt: skip


def workload(n: int, seed: int, min_words: int, max_words: int, min_out: int, max_out: int):
    rng = random.Random(seed)
    return [
        (" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))),
         rng.randint(min_out, max_out))
        for _ in range(n)
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    cuts = (
        statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    )
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            tokens += 1
            first = first or time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "e2e": end - start, "tokens": tokens,
            "tpot": (end - first) / max(tokens - 1, 1)}  # fmt: skip


async def run_level(base_url: str, model: str, jobs: list, concurrency: int) -> dict:
    import openai

    sem = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=2) as c:

        async def bounded(prompt, max_tokens):
            async with sem:
                return await _one(c, model, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p, m) for p, m in jobs))
        wall = time.perf_counter() - start
    row = {"concurrency": concurrency, "requests": len(jobs),
           "output_tok_s": sum(r["tokens"] for r in results) / wall}  # fmt: skip
    for key in ("ttft", "tpot", "e2e"):
        for name, value in _percentiles([r[key] for r in results]).items():
            row[f"{key}_{name}_ms"] = value * 1e3
    return row


def serve_ours(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--port", str(port), "--dtype",
           args.dtype, "--max-num-seqs", str(max(args.levels)),
           "--served-model-name", "model", *args.serve_args]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def serve_llama(port: int, parallel: int, threads: int) -> subprocess.Popen:
    cmd = [str(peers.llama_tool("llama-server")), "-m", str(peers.gguf("bf16")),
           "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
           "-c", str(1024 * parallel), "-t", str(threads), "-tb", str(threads),
           "--threads-http", str(parallel + 4), "--alias", "model"]  # fmt: skip
    log = open(f"/tmp/llama-server-{port}.log", "w")  # noqa: SIM115 - lives with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-words", type=int, default=16)
    parser.add_argument("--max-words", type=int, default=128)
    parser.add_argument("--min-out", type=int, default=32)
    parser.add_argument("--max-out", type=int, default=96)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                        help="extra `compilecore serve` argument (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    rows = []
    port = _free_port()
    proc = serve_ours(args, port)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        for level in args.levels:
            jobs = workload(max(level * args.requests_per_client, 4), level, args.min_words,
                            args.max_words, args.min_out, args.max_out)  # fmt: skip
            asyncio.run(run_level(f"http://127.0.0.1:{port}", "model", jobs[:1], 1))  # warm-up
            row = asyncio.run(run_level(f"http://127.0.0.1:{port}", "model", jobs, level))
            rows.append({"engine": "compilecore serve", **row})
            print(rows[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lacking = peers.missing(tools=("llama-server",)) if args.model is None else ["GGUF"]
    peers.report_missing(lacking)
    for level in args.levels if not lacking else []:
        port = _free_port()
        proc = serve_llama(port, level, threads)
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", proc)
            jobs = workload(max(level * args.requests_per_client, 4), level, args.min_words,
                            args.max_words, args.min_out, args.max_out)  # fmt: skip
            asyncio.run(run_level(f"http://127.0.0.1:{port}", "model", jobs[:1], 1))
            row = asyncio.run(run_level(f"http://127.0.0.1:{port}", "model", jobs, level))
            rows.append({"engine": f"llama-server --parallel {level}", **row})
            print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    theirs = {r["concurrency"]: r for r in rows if r["engine"].startswith("llama")}
    for r in rows:
        peer = theirs.get(r["concurrency"])
        if peer and r is not peer:
            r["vs_llama_server"] = r["output_tok_s"] / peer["output_tok_s"]
    rows.sort(key=lambda r: (r["concurrency"], r["engine"]))
    columns = ["engine", "concurrency", "output_tok_s", "vs_llama_server", "ttft_p50_ms",
               "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms"]  # fmt: skip
    title = (
        f"serving, greedy streams, prompts {args.min_words}-{args.max_words} words, outputs "
        f"{args.min_out}-{args.max_out} tokens, {args.dtype}, {threads} threads"
    )
    return save_results("serve", rows, columns, title, Path(args.out), chart_key="output_tok_s")


if __name__ == "__main__":
    main()
