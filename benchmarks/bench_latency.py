"""Batch-1 decode of the default model (or --model), side by side with every peer in one
run: llama.cpp through llama-cpp-python on a GGUF of the same weights (built by
benchmarks/setup_peers.sh), HF transformers eager and (with --hf-compile) static cache +
torch.compile with freezing, and this engine eager and compiled, with the CPU's read
bandwidth measured in the same run as the ceiling, and each of compilecore's and
llama.cpp's runs also against the bandwidth measured just before and after it (the
machine's memory swings by up to 2x within a minute). A last row is the memory's own
decode: one sum over the weights' bytes per token, in the same rounds, which shows what
share of the best-of-run ceiling a pure weight stream reaches in those minutes.

Every engine decodes `--tokens` tokens greedily (with `--sampled`: temperature 0.8, top-p
0.95, vLLM's quickstart settings) after the same chat prompt (the same token ids), without
stopping at EOS, and is timed the same way: tokens/s between the first and the last
generated token, (N - 1) / (t_N - t_1).

    python benchmarks/bench_latency.py --tokens 128 --hf-compile [--sampled]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    SAMPLED,
    PairedBandwidth,
    WeightsRead,
    bf16_default,
    bytes_read_per_token,
    decode_once,
    decode_speed,
    drawn,
    read_bandwidth,
    save_results,
    weight_bytes,
)

from runtime import LLM  # noqa: E402

QUESTION = "What is the capital of France?"


def chat_prompt(llm: LLM) -> list[int]:
    """The question in the model's chat template (raw when it has none), as token ids."""
    try:
        return llm.apply_chat_template([{"role": "user", "content": QUESTION}])["prompt_token_ids"]
    except ValueError:
        return llm.tokenizer.encode(QUESTION)


class _TokenTimes:
    """An HF streamer that notes when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_speed(
    model_dir: str,
    dtype: torch.dtype,
    prompt: list[int],
    tokens: int,
    compile_: bool,
    sampling: dict | None = None,
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if sampling:  # HF's top-k (50 by default) off, like every engine's
        kwargs.update(do_sample=True, top_k=0, **sampling)
    if compile_:  # HF's best CPU setting: static cache, compiled, weights frozen
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, fullgraph=True)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, **kwargs)  # warm-up (and compile)
        streamer = _TokenTimes()
        model.generate(ids, streamer=streamer, **kwargs)
    if compile_:
        inductor_config.freezing = False
    t = streamer.times
    return (len(t) - 1) / (t[-1] - t[0])


MEMORY = "memory (a sum over the weights' bytes per token)"


def paired_rounds(
    llm: LLM,
    prompt: list[int],
    gguf: Path | None,
    weights: int,
    ours_bytes: int,
    args: argparse.Namespace,
) -> tuple[dict[str, dict], list[float]]:
    """compilecore, llama.cpp (with a GGUF) and the memory's own decode (`WeightsRead`) in
    alternating rounds (on a machine whose speed swings by the minute, one run each
    minutes apart compares two different machines), every run paired with the read
    bandwidth just around it. Returns their rows by role ("ours", "theirs" with a GGUF,
    "memory"; each its best round's median tok/s and its median share of the paired
    bandwidth, counting the bytes it reads: `ours_bytes` for compilecore, all `weights`
    for the others) and the ceiling measurements taken between rounds."""
    threads = torch.get_num_threads()
    paired, memory = PairedBandwidth(args.ceiling_mb << 20), WeightsRead(weights)
    shares: dict[str, list[float]] = {"ours": [], "theirs": [], "memory": []}
    best = dict.fromkeys(shares, 0.0)
    bandwidths = []

    def timed(name: str) -> Callable[[Callable[[], float]], float]:
        nbytes = ours_bytes if name == "ours" else weights
        return functools.partial(paired.around, bytes_per_unit=nbytes, shares=shares[name])

    for _ in range(max(1, args.rounds)):
        speed = decode_speed(llm, prompt, args.tokens, args.repeats, timed("ours"), args.sampling)
        best["ours"] = max(best["ours"], speed)
        if gguf is not None:
            run = functools.partial(
                peers.llama_cpp_decode, gguf, prompt, args.tokens, threads, args.sampling
            )
            best["theirs"] = max(best["theirs"], timed("theirs")(run))
        read = functools.partial(memory.decode, args.tokens)
        runs = [timed("memory")(read) for _ in range(args.repeats)]
        best["memory"] = max(best["memory"], statistics.median(runs))
        bandwidths.append(read_bandwidth(nbytes=args.ceiling_mb << 20))
    names = {"ours": "compilecore compiled"}
    if gguf is not None:
        names["theirs"] = f"llama.cpp ({gguf.stem.rsplit('-', 1)[-1].upper()})"
    names["memory"] = MEMORY
    rows = {
        key: {"engine": engine, "tok_s": best[key], "of_paired_bw": statistics.median(shares[key]),
              "MB_read": (ours_bytes if key == "ours" else weights) / 1e6}
        for key, engine in names.items()
    }  # fmt: skip
    return rows, bandwidths


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="compilecore compiled and llama.cpp alternate this many times; "
                        "each keeps its best round")  # fmt: skip
    parser.add_argument("--hf-compile", action="store_true", help="also HF static+compile")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF peers")
    parser.add_argument("--gguf", default=None, help="llama.cpp's GGUF (default: the peers')")
    parser.add_argument("--sampled", action="store_true",
                        help=f"sample ({SAMPLED}) instead of greedy, in every engine")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS))
    mb = "MB each bandwidth sum reads (more than the last-level cache)"
    parser.add_argument("--ceiling-mb", type=int, default=512, help=mb)
    args = parser.parse_args(argv)
    args.sampling = SAMPLED if args.sampled else None
    threads = torch.get_num_threads()
    # Measured before, between and after the engines (and each round); the ceiling is the
    # largest.
    bandwidths = [read_bandwidth(nbytes=args.ceiling_mb << 20)]
    rows = []
    gguf = Path(args.gguf) if args.gguf else (peers.gguf("bf16") if args.model is None else None)
    lacking = [] if gguf else ["a GGUF of these weights (--gguf)"]
    lacking += [] if peers.has_llama_cpp_python() else ["llama-cpp-python"]
    engines = (("compilecore compiled", {}), ("compilecore eager", {"enforce_eager": True}))
    for name, kwargs in engines:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  kv_cache_memory=64 << 20, **kwargs, **bf16_default(args.model))  # fmt: skip
        prompt = chat_prompt(llm)
        weights = weight_bytes(llm)
        if name == "compilecore compiled":
            decode_once(llm, prompt, 8, args.sampling)  # a greedy step makes the head's screen
            ours_bytes = bytes_read_per_token(llm, args.sampling)
            theirs = None if lacking else gguf
            paired, taken = paired_rounds(llm, prompt, theirs, weights, ours_bytes, args)
            rows.append(paired["ours"])
            bandwidths += taken
        else:
            ours = decode_speed(llm, prompt, args.tokens, args.repeats, sampling=args.sampling)
            rows.append({"engine": name, "tok_s": ours, "MB_read": weights / 1e6})
        model_dir = llm.engine_config.model_config.model
        dtype = llm.engine_config.model_config.dtype
        del llm
        gc.collect()
        bandwidths.append(read_bandwidth(nbytes=args.ceiling_mb << 20))
    rows += [paired["theirs"]] if "theirs" in paired else []
    peers.report_missing(lacking)
    if not args.no_hf:
        hf = [("HF eager", False)] + [("HF static+compile+freezing", True)] * args.hf_compile
        for name, compiled in hf:
            speed = hf_decode_speed(model_dir, dtype, prompt, args.tokens, compiled, args.sampling)
            rows.append({"engine": name, "tok_s": speed, "MB_read": weights / 1e6})
    rows.append(paired["memory"])  # last in the table, after every engine
    bandwidths.append(read_bandwidth(nbytes=args.ceiling_mb << 20))
    ceiling_gbs = max(bandwidths)
    ceiling = ceiling_gbs * 1e9 / weights
    reference = next((r["tok_s"] for r in rows if r["engine"].startswith("llama.cpp")), None)
    for r in rows:
        r["GB_s"] = r["MB_read"] * r["tok_s"] / 1e3
        r["of_ceiling"] = r["GB_s"] / ceiling_gbs
        r["of_floor_speed"] = r["tok_s"] / ceiling
        if reference:
            r["vs_llama_cpp"] = r["tok_s"] / reference
    title = (
        f"batch-1 decode, {args.tokens} tokens after a chat prompt, "
        f"{drawn(args.sampling)}, {args.dtype}, {threads} "
        f"threads; read bandwidth {ceiling_gbs:.1f} GB/s (best of {len(bandwidths)} measurements "
        f"through the run, lowest {min(bandwidths):.1f}), weights {weights / 1e6:.0f} MB per "
        f"token, floor speed {ceiling:.0f} tok/s (all weights read at the ceiling); GB_s: "
        f"MB_read (the bytes each engine reads a token) x tok/s; of_ceiling: GB_s against the "
        f"ceiling; of_floor_speed: tok/s against the floor speed; of_paired_bw: median over "
        f"runs of a run's GB/s against sums just before and after it"
    )
    columns = ["engine", "tok_s", "vs_llama_cpp", "MB_read", "GB_s", "of_ceiling",
               "of_floor_speed", "of_paired_bw"]  # fmt: skip
    name = "latency_sampled" if args.sampled else "latency"
    return save_results(name, rows, columns, title, Path(args.out), chart_key="tok_s")


if __name__ == "__main__":
    main()
