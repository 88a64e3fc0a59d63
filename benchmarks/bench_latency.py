"""Batch-1 decode of the default model (or --model), side by side with its peers in one
run: HF transformers eager (and, with --hf-compile, static cache + torch.compile), this
engine eager and compiled, llama.cpp when `llama_cpp` is installed and --gguf is given.
Reports tok/s, achieved GB/s (weight bytes x tok/s) and that as a share of the copy
bandwidth measured in the same run.

    python benchmarks/bench_latency.py --dtype bfloat16 --tokens 128
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    PROMPT_37,
    RESULTS,
    copy_bandwidth,
    decode_speed,
    save_results,
    weight_bytes,
)

from runtime import LLM  # noqa: E402


def hf_decode_speed(model_dir: str, dtype: torch.dtype, tokens: int, compile_: bool) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if compile_:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([PROMPT_37])
    with torch.inference_mode():
        model.generate(ids, **kwargs)  # warm-up (and compile)
        start = time.perf_counter()
        model.generate(ids, **kwargs)
    return tokens / (time.perf_counter() - start)


def llama_cpp_speed(gguf: str, tokens: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(gguf, n_threads=torch.get_num_threads(), verbose=False)
    llm(" ".join(["hello"] * 30), max_tokens=8)
    start = time.perf_counter()
    out = llm(" ".join(["hello"] * 30), max_tokens=tokens, temperature=0)
    return out["usage"]["completion_tokens"] / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-compile", action="store_true", help="also HF static cache + compile")
    parser.add_argument("--gguf", default=None, help="a GGUF of the same weights for llama.cpp")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth()
    rows = []
    for name, kwargs in (
        ("compilecore eager", {"enforce_eager": True}),
        ("compilecore compiled", {}),
    ):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            kv_cache_memory=64 << 20,
            **kwargs,
        )
        weights = weight_bytes(llm)
        rows.append(
            {"engine": name, "tok_s": decode_speed(llm, PROMPT_37, args.tokens, args.repeats)}
        )
        model_dir = llm.engine_config.model_config.model
        dtype = llm.engine_config.model_config.dtype
        del llm
        gc.collect()
    rows.append(
        {"engine": "HF eager", "tok_s": hf_decode_speed(model_dir, dtype, args.tokens, False)}
    )
    if args.hf_compile:
        rows.append(
            {
                "engine": "HF static+compile",
                "tok_s": hf_decode_speed(model_dir, dtype, args.tokens, True),
            }
        )
    if args.gguf:
        speed = llama_cpp_speed(args.gguf, args.tokens)
        rows.append({"engine": "llama.cpp", "tok_s": speed})
    base = next(r["tok_s"] for r in rows if r["engine"] == "HF eager")
    for r in rows:
        if r["tok_s"]:
            r["GB_s"] = weights * r["tok_s"] / 1e9
            r["of_copy_bw"] = r["GB_s"] / bandwidth
            r["vs_HF_eager"] = r["tok_s"] / base
    title = (
        f"batch-1 decode, {args.dtype}, {torch.get_num_threads()} threads, copy bandwidth "
        f"{bandwidth:.1f} GB/s, weights {weights / 1e6:.0f} MB"
    )
    return save_results(
        "latency",
        rows,
        ["engine", "tok_s", "vs_HF_eager", "GB_s", "of_copy_bw"],
        title,
        Path(args.out),
        chart_key="tok_s",
    )


if __name__ == "__main__":
    main()
