"""Pass ablation: batch-1 decode of the default model with each fusion pass on or off,
against Inductor alone, side by side in one process.

    python benchmarks/pass_ablation.py --dtype bfloat16 --tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import PROMPT_37, compare, decode_speed, print_table  # noqa: E402

OFF = {"fuse_add_rms_norm": False, "fuse_qkv_rope": False}
VARIANTS = {
    "inductor-alone": OFF,
    "+add_rms_norm": {**OFF, "fuse_add_rms_norm": True},
    "+qkv_rope": {**OFF, "fuse_qkv_rope": True},
    "+both": {"fuse_add_rms_norm": True, "fuse_qkv_rope": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    variants = {n: {"compilation_config": {"passes": p}} for n, p in VARIANTS.items()}
    results = compare(
        variants,
        lambda llm: decode_speed(llm, PROMPT_37, args.tokens, args.repeats),
        model=args.model,
        dtype=args.dtype,
        max_model_len=1024,
        kv_cache_memory=64 << 20,
    )
    print_table(results, f"pass ablation, batch-1 decode, {args.dtype}", "inductor-alone")


if __name__ == "__main__":
    main()
