"""Which compile settings are fastest on this machine? Batch-1 decode of the default
model (or --model) under each variant, side by side in one process, as ratios to eager.

    python benchmarks/compile_options.py --dtype bfloat16 --tokens 128 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import compare_decode, decode_parser, print_table  # noqa: E402

AUTOTUNE = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "CPP,ATEN"}
VARIANTS = {
    "eager": {"enforce_eager": True},
    "piecewise": {},
    "piecewise-cpu_graphs": {"compilation_config": {"cpu_graphs": False}},
    "whole-graph": {"compilation_config": {"splitting_ops": []}},
    "piecewise+cpp_wrapper": {"compilation_config": {"inductor_options": {"cpp_wrapper": True}}},
    "piecewise-size_asserts": {"compilation_config": {"inductor_options": {"size_asserts": False}}},
    "whole-graph+cpp_wrapper": {
        "compilation_config": {"splitting_ops": [], "inductor_options": {"cpp_wrapper": True}}
    },
    "piecewise+max_autotune_gemm": {"compilation_config": {"inductor_options": AUTOTUNE}},
    "whole-graph+max_autotune_gemm": {
        "compilation_config": {"splitting_ops": [], "inductor_options": AUTOTUNE}
    },
}


def main() -> None:
    parser = decode_parser(__doc__)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    results = compare_decode(args, {name: VARIANTS[name] for name in args.variants})
    print_table(results, f"batch-1 decode, {args.dtype}", args.variants[0])


if __name__ == "__main__":
    main()
