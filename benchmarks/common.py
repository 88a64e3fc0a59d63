"""Shared helpers for the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from runtime import LLM, SamplingParams

PROMPT_37 = list(range(100, 137))  # a 37-token prompt


def decode_speed(llm: LLM, prompt: list[int], tokens: int, repeats: int) -> float:
    """Median batch-1 decode tokens/s over `repeats` runs, after one warm-up run."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    speeds = []
    for _ in range(repeats):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        speeds.append(out.metrics.decode_tokens_per_s)
    return sorted(speeds)[len(speeds) // 2]


def compare(variants: dict[str, dict], measure: Callable[[LLM], float], **llm_kwargs) -> dict:
    """Build an LLM per variant in turn (one process), measure it, free it."""
    results = {}
    for name, kwargs in variants.items():
        start = time.perf_counter()
        llm = LLM(**llm_kwargs, **kwargs)
        startup = time.perf_counter() - start
        results[name] = {"tok_s": measure(llm), "startup_s": startup}
        print(name, results[name], flush=True)
        del llm
        gc.collect()
    return results


def print_table(results: dict, title: str, baseline: str) -> None:
    base = results[baseline]["tok_s"]
    print(f"\n{title} ({torch.get_num_threads()} threads)")
    print(f"| variant | tok/s | vs {baseline} | start-up s |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {r['startup_s']:.1f} |")
