"""Batch-invariant mode's cost: the default engine against `batch_invariant=True` on the
same model, in interleaved rounds (one process), batch-1 greedy decode and B x (L + L)
with fresh prompts each round (no prefix-cache hits; the mode takes none anyway).

    python benchmarks/bench_invariant.py --rounds 3            # the default model (Q4_1)
    python benchmarks/bench_invariant.py --model x.gguf --batch 16 --length 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import fixed_shapes  # noqa: E402
from common import PROMPT_37, decode_speed, machine  # noqa: E402

from runtime import LLM  # noqa: E402

VARIANTS = {"default": {}, "invariant": {"batch_invariant": True}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="batch-1 decode length")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128, help="prompt and output tokens")
    args = parser.parse_args(argv)
    llms = {name: LLM(args.model, max_model_len=1024, max_num_seqs=max(args.batch, 1),
                      compilation_config=cc) for name, cc in VARIANTS.items()}  # fmt: skip
    vocab = next(iter(llms.values())).engine_config.model_config.hf_config.vocab_size
    speeds: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        names = list(llms) if r % 2 == 0 else list(llms)[::-1]
        for name in names:
            tok_s = decode_speed(llms[name], PROMPT_37, args.tokens, 1)
            speeds.setdefault((name, "batch 1"), []).append(tok_s)
            if args.batch:
                row = fixed_shapes(llms[name], [args.batch], args.length, vocab, seed=97 * r + 1)
                speeds.setdefault((name, f"{args.batch} x"), []).append(row[0]["tok_s"])
        print(f"round {r + 1}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.1f}"
                                             for k, v in speeds.items()))  # fmt: skip
    print(f"\n{machine()['cpu_model']}, model {args.model or 'default (Q4_1)'}, "
          f"{args.rounds} interleaved rounds")  # fmt: skip
    print("| shape | default tok/s | invariant tok/s | invariant / default, median (range) |")
    print("|---|---|---|---|")
    for shape in sorted({k[1] for k in speeds}):
        base, inv = speeds[("default", shape)], speeds[("invariant", shape)]
        ratios = [a / b for a, b in zip(inv, base)]
        print(
            f"| {shape} | {statistics.median(base):.1f} | {statistics.median(inv):.1f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return speeds


if __name__ == "__main__":
    main()
