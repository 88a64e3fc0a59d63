"""Batch-1 decode of one float checkpoint as bf16 and quantized at load
(`LLM(folder, quantization="int8" | "int4" | ...)`), the engines alive in one process and
measured in alternating rounds on fresh prompts; prints each one's tok/s and its ratio to
bf16 (median and range over the rounds).

    python benchmarks/bench_quantize_at_load.py [--model FOLDER] [--formats int8,int4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_once, machine  # noqa: E402

from models.default_model import ensure_default_model  # noqa: E402
from runtime import LLM  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Runs the rounds; returns each engine's median ratio to bf16."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a float checkpoint (default model's)")
    parser.add_argument("--formats", default="int8,int4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    folder = args.model or str(ensure_default_model())
    common = {"dtype": "bfloat16", "load_format": "safetensors", "max_model_len": 512}
    engines = {"bf16": LLM(folder, **common)}
    for fmt in args.formats.split(","):
        engines[fmt] = LLM(folder, quantization=fmt, **common)
    vocab = engines["bf16"].engine_config.model_config.hf_config.vocab_size
    rng = random.Random(0)
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):  # a fresh prompt for every run: no prefix-cache hits
        for name, llm in list(engines.items())[:: 1 if r % 2 else -1]:
            prompt = [rng.randrange(100, vocab) for _ in range(16)]
            speeds[name].append(decode_once(llm, prompt, args.tokens))
    print(f"{folder}, {machine()['cpu_model']}, {args.rounds} rounds x {args.tokens} tokens")
    ratios = {}
    for name, values in speeds.items():
        per = sorted(v / b for v, b in zip(values, speeds["bf16"]))
        ratios[name] = statistics.median(per)
        print(f"{name}: {statistics.median(values):.1f} tok/s, {ratios[name]:.2f}x bf16 "
              f"({per[0]:.2f}-{per[-1]:.2f})")  # fmt: skip
    return ratios


if __name__ == "__main__":
    main()
