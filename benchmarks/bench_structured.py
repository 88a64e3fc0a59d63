"""The cost of a structured output: batch-1 decode of the same prompt, alternating rounds,
without a constraint, held to a regex (600 letters and spaces: longer than any round, so
the grammar never ends first) and to a JSON schema (an array of strings, which a round may
close early), each round up to `--tokens` tokens. Prints decode tok/s per round (after
the first token) and the median ratio of each constrained kind to the free one.

    python benchmarks/bench_structured.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {"type": "array", "items": {"type": "string"}}


def main(argv: list[str] | None = None) -> dict:
    from runtime import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype)
    prompt = "List some fruit names as a JSON array of strings:"
    kinds = {
        "free": None,
        "regex": {"regex": "[a-z ]{600}"},
        "json schema": {"json": SCHEMA, "disable_any_whitespace": True},
    }
    speeds: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds + 1):  # round 0 warms both up (graphs, grammar compile)
        for kind, spec in kinds.items():
            params = SamplingParams(temperature=0.8, seed=r, max_tokens=args.tokens,
                                    ignore_eos=True, structured_outputs=spec)  # fmt: skip
            out = llm.generate([prompt + f" ({r})"], params, use_tqdm=False)[0]
            if r:
                speeds[kind].append(out.metrics.decode_tokens_per_s)
    result: dict = {k: [round(v, 1) for v in s] for k, s in speeds.items()}
    for kind in list(kinds)[1:]:
        ratios = [c / f for c, f in zip(speeds[kind], speeds["free"])]
        result[f"{kind} / free"] = (round(statistics.median(ratios), 3),
                                    round(min(ratios), 3), round(max(ratios), 3))  # fmt: skip
    print(result)
    return result


if __name__ == "__main__":
    main()
