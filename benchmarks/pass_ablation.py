"""Pass ablation: batch-1 decode of the default model with each fusion pass on or off,
against Inductor alone, side by side in one process.

    python benchmarks/pass_ablation.py --dtype bfloat16 --tokens 128 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import compare_decode, decode_parser, print_table  # noqa: E402

OFF = {"fuse_add_rms_norm": False, "fuse_qkv_rope": False}
VARIANTS = {
    "inductor-alone": OFF,
    "+add_rms_norm": {**OFF, "fuse_add_rms_norm": True},
    "+qkv_rope": {**OFF, "fuse_qkv_rope": True},
    "+both": {"fuse_add_rms_norm": True, "fuse_qkv_rope": True},
}


def main() -> None:
    args = decode_parser(__doc__).parse_args()
    variants = {n: {"compilation_config": {"passes": p}} for n, p in VARIANTS.items()}
    results = compare_decode(args, variants)
    print_table(results, f"pass ablation, batch-1 decode, {args.dtype}", "inductor-alone")


if __name__ == "__main__":
    main()
