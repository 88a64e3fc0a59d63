"""Which compile settings are fastest on this machine? Batch-1 decode of the default
model (or --model) under each variant, side by side in one process, as ratios to eager.

    python benchmarks/compile_options.py --dtype bfloat16 --tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from runtime import LLM, SamplingParams

VARIANTS = {
    "eager": {"enforce_eager": True},
    "piecewise": {},
    "whole-graph": {"compilation_config": {"splitting_ops": []}},
    "piecewise+cpp_wrapper": {"compilation_config": {"inductor_options": {"cpp_wrapper": True}}},
    "piecewise+max_autotune_gemm": {
        "compilation_config": {
            "inductor_options": {
                "max_autotune_gemm": True,
                "max_autotune_gemm_backends": "CPP,ATEN",
            }
        }
    },
    "whole-graph+max_autotune_gemm": {
        "compilation_config": {
            "splitting_ops": [],
            "inductor_options": {
                "max_autotune_gemm": True,
                "max_autotune_gemm_backends": "CPP,ATEN",
            },
        }
    },
}


def decode_speed(llm: LLM, prompt: list[int], tokens: int, repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    speeds = []
    for _ in range(repeats):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        speeds.append(out.metrics.decode_tokens_per_s)
    return sorted(speeds)[len(speeds) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    prompt = list(range(100, 137))  # 37 tokens
    results = {}
    for name in args.variants:
        start = time.perf_counter()
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=1024,
            kv_cache_memory=64 << 20,
            **VARIANTS[name],
        )
        startup = time.perf_counter() - start
        results[name] = {
            "decode_tok_s": decode_speed(llm, prompt, args.tokens, args.repeats),
            "startup_s": startup,
        }
        print(name, json.dumps(results[name]), flush=True)
        del llm
        gc.collect()
    base = results.get("eager", next(iter(results.values())))["decode_tok_s"]
    print(f"\nbatch-1 decode, {args.dtype}, {torch.get_num_threads()} threads")
    print("| variant | decode tok/s | vs eager | start-up s |\n|---|---|---|---|")
    for name, r in results.items():
        speed = r["decode_tok_s"]
        print(f"| {name} | {speed:.1f} | {speed / base:.2f}x | {r['startup_s']:.1f} |")


if __name__ == "__main__":
    main()
