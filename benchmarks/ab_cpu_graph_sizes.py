"""Batched decode with CPU graphs at the default sizes (1-16, then 24, 32, ... 64) against
graphs up to 16 rows only (larger batches piece by piece, as before):
two engines of one model alive in one process, B x (128 + 128) on fresh prompts in
alternating rounds; prints each round's times, the median ratio and its range, and
whether both engines give the same greedy tokens on one set of prompts.

    python benchmarks/ab_cpu_graph_sizes.py [--model FILE_OR_FOLDER] [--batch 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> float:
    """Runs the rounds; returns the median of (time up to 16) / (time at default sizes)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the shipped default model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="prompt and output tokens")
    args = parser.parse_args(argv)
    kwargs = {"max_model_len": 2 * args.tokens + 16}
    engines = {
        "up to 16": LLM(args.model, compilation_config={"cpu_graph_sizes": list(range(1, 17))},
                        **kwargs),
        "default": LLM(args.model, **kwargs),
    }  # fmt: skip
    vocab = engines["default"].engine_config.model_config.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def prompts() -> list[dict]:  # fresh every run: no prefix-cache hits
        return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.tokens)]}
                for _ in range(args.batch)]  # fmt: skip

    print(f"{args.model or 'default model'}, {machine()['cpu_model']}, {args.batch} x "
          f"({args.tokens} + {args.tokens}), {args.rounds} rounds")  # fmt: skip
    ratios = []
    for r in range(args.rounds):
        times = {}
        for name, llm in list(engines.items())[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            llm.generate(prompts(), params, use_tqdm=False)
            times[name] = time.perf_counter() - t0
        ratios.append(times["up to 16"] / times["default"])
        print(f"round {r}: up to 16 {times['up to 16']:.2f} s, default {times['default']:.2f} s,"
              f" {ratios[-1]:.3f}x", flush=True)  # fmt: skip
    same = prompts()
    tokens = [[o.outputs[0].token_ids for o in llm.generate(same, params, use_tqdm=False)]
              for llm in engines.values()]  # fmt: skip
    equal = sum(a == b for a, b in zip(*tokens))
    median = statistics.median(ratios)
    print(f"default / up to 16: {median:.3f}x ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"same tokens {equal}/{args.batch}")  # fmt: skip
    return median


if __name__ == "__main__":
    main()
