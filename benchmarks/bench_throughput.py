"""Offline throughput, in one run:

1. Mixed lengths: 64 requests with seeded prompt and output lengths uniform in 64-256,
   `ignore_eos`, this engine (continuous batching) against HF transformers' batched
   `generate` (padded, length-sorted batches of --hf-batch, after a warm-up). Only
   requested tokens count. Greedy, or with `--sampled` vLLM's quickstart sampling
   (temperature 0.8, top-p 0.95) in both engines.
2. Fixed shapes, B x (128-token prompt + 128 tokens) for B in --batches, against
   llama.cpp's `llama-batched-bench` at the same shapes on a GGUF of the same weights
   (built by benchmarks/setup_peers.sh): wall time of the whole batch, and tokens (prompt
   + generated) per second, as llama-batched-bench counts them.

    python benchmarks/bench_throughput.py [--sampled]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
from common import GREEDY, RESULTS, SAMPLED, bf16_default, drawn, save_results  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402


def workload(n: int, low: int, high: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]
    outputs = [rng.randint(low, high) for _ in range(n)]
    return prompts, outputs


def ours(llm: LLM, prompts, outputs, sampling: dict | None = None) -> float:
    draw = sampling or GREEDY
    params = [SamplingParams(**draw, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == outputs
    return sum(outputs) / elapsed


def hf(model_dir: str, dtype, prompts, outputs, batch: int, sampling: dict | None = None) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    # Length-sorted batches pad least; a warm-up keeps first-call costs out of the timing.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    prompts, outputs = [prompts[i] for i in order], [outputs[i] for i in order]
    draw = {"do_sample": True, "top_k": 0, **sampling} if sampling else {"do_sample": False}
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk, lens = prompts[i : i + batch], outputs[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                pad_token_id=0,
                **draw,
            )
    return sum(outputs) / (time.perf_counter() - start)


def fixed_shapes(
    llm: LLM, batches: list[int], length: int, vocab: int, seed: int = 1
) -> list[dict]:
    """B x (length + length) per B; prompts drawn from `seed`, so a round with a seed of
    its own never hits the prefix cache an earlier round filled."""
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    rng = random.Random(seed)
    rows = []
    for b in batches:
        prompts = [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(b)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rows.append({"engine": "compilecore compiled", "batch": b, "seconds": seconds,
                     "tok_s": b * 2 * length / seconds})  # fmt: skip
    return rows


def llama_batched_bench(
    batches: list[int], length: int, threads: int, gguf: Path | None = None, label: str = "BF16"
) -> list[dict]:
    tool, gguf = peers.llama_tool("llama-batched-bench"), gguf or peers.gguf("bf16")
    ctx = max(batches) * 2 * length + 256
    cmd = [str(tool), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(length), "-ntg", str(length), "-npl", ",".join(map(str, batches)),
           "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows.append({"engine": f"llama.cpp {label} (llama-batched-bench)", "batch": r["pl"],
                         "seconds": r["t"], "tok_s": r["speed"]})  # fmt: skip
    return rows


def _best(kept: list[dict], new: list[dict]) -> list[dict]:
    """Per batch, the faster of two rounds' rows."""
    best = {r["batch"]: r for r in kept}
    for r in new:
        if r["batch"] not in best or r["seconds"] < best[r["batch"]]["seconds"]:
            best[r["batch"]] = r
    return list(best.values())


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--batches", default="1,16,64", help="fixed shapes; '' to skip")
    parser.add_argument("--length", type=int, default=128, help="prompt = output length")
    parser.add_argument("--rounds", type=int, default=2,
                        help="fixed shapes: compilecore and llama-batched-bench alternate this "
                        "many times; each keeps its best time per batch")  # fmt: skip
    parser.add_argument("--sampled", action="store_true",
                        help=f"mixed lengths: sample ({SAMPLED}) instead of greedy")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    sampling = SAMPLED if args.sampled else None
    max_seqs = max([args.requests] + [int(b) for b in args.batches.split(",") if b])
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max_seqs,
        **bf16_default(args.model),
    )
    vocab = llm.engine_config.model_config.hf_config.vocab_size
    prompts, outputs = workload(args.requests, args.min_len, args.max_len, vocab)
    rows = [{"engine": "compilecore compiled", "tok_s": ours(llm, prompts, outputs, sampling)}]
    batches = [int(b) for b in args.batches.split(",") if b]
    threads = torch.get_num_threads()
    lacking = peers.missing(tools=("llama-batched-bench",)) if args.model is None else ["GGUF"]
    shapes, theirs = [], []
    rounds = max(1, args.rounds) if not lacking else 1  # alone, one round says it all
    for round_ in range(rounds if batches else 0):
        # Interleaved, best of the rounds for each: the machine's speed swings by the minute.
        shapes = _best(shapes, fixed_shapes(llm, batches, args.length, vocab, seed=round_ + 1))
        if not lacking:
            theirs = _best(theirs, llama_batched_bench(batches, args.length, threads))
    model_dir, dtype = llm.engine_config.model_config.model, llm.engine_config.model_config.dtype
    llm.shutdown()
    del llm
    gc.collect()
    if not args.skip_hf:
        rows.append(
            {
                "engine": f"HF generate (batch {args.hf_batch})",
                "tok_s": hf(model_dir, dtype, prompts, outputs, args.hf_batch, sampling),
            }
        )
        for r in rows:
            r["vs_HF"] = r["tok_s"] / rows[-1]["tok_s"]
    if shapes and not lacking:
        theirs = {r["batch"]: r for r in theirs}
        for r in list(shapes):
            if r["batch"] in theirs:
                r["vs_llama_cpp"] = theirs[r["batch"]]["seconds"] / r["seconds"]
                shapes.append(theirs[r["batch"]])
    if shapes:
        peers.report_missing(lacking)
        shapes.sort(key=lambda r: r["batch"])
        title = (
            f"B x ({args.length}-token prompt + {args.length} tokens), {args.dtype}, "
            f"{threads} threads: wall seconds, (prompt + generated) tokens/s"
        )
        columns = ["engine", "batch", "seconds", "tok_s", "vs_llama_cpp"]
        save_results("batched", shapes, columns, title, Path(args.out))
    title = (
        f"offline throughput, {args.requests} requests, lengths {args.min_len}-"
        f"{args.max_len}, {drawn(sampling)}, {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    return save_results(
        "throughput_sampled" if args.sampled else "throughput",
        rows,
        ["engine", "tok_s", "vs_HF"],
        title,
        Path(args.out),
        chart_key="tok_s",
    )


if __name__ == "__main__":
    main()
