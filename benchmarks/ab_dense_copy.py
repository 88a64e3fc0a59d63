"""Where q8's batched products should leave the strips for a dense copy: `q8_linear`'s
kernel paths (strips on int8 activations, exact strips) against a GEMM on the weight
dequantized into a fresh tensor or into the reused scratch (rounded to bf16, or split into
[hi | lo]), in one process, rounds alternating; median ms per call and the range
(docs/kernel-choices.md, Strips; passes/ops/scratch.py).

    python benchmarks/ab_dense_copy.py --rows 64,128,512 --shapes 3072x576,16384x2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from passes.ops import quantized as q  # noqa: E402


def strips(x, w, s, int8_x: bool) -> torch.Tensor:
    """`q8_linear` on its kernel's strips at any row count (the AMX limit lifted)."""
    limit, q.AMX_DENSE_ROWS = q.AMX_DENSE_ROWS, 1 << 30
    try:
        return q.q8_linear(x, w, s, int8_x=int8_x)
    finally:
        q.AMX_DENSE_ROWS = limit


def variants(x, w, s) -> dict:
    bf16 = torch.bfloat16
    return {
        "int8 strips": lambda: strips(x, w, s, True),
        "exact strips": lambda: strips(x, w, s, False),
        "rounded, fresh copy": lambda: F.linear(x, q.dequantize_q8(w, s, bf16)),
        "rounded, scratch": lambda: q.dense_from_blocks(x, w, (s,), None, None, bf16),
        "split, scratch": lambda: q.dense_from_blocks(x, w, (s,), None, None, bf16, True),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,128,512")
    parser.add_argument("--shapes", default="960x576,3072x576,576x1536,4096x2048,16384x2048")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(machine())
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s = (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            runs = variants(x, w, s)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    run()
                    start = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - start) * 1e3)
            cells = [f"{name} {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"
                     for name, t in times.items()]  # fmt: skip
            print(f"{n}x{k} rows {m}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
