"""Q4_K's scales and mins as stored (compact: 6-bit sub-block bytes and fp32 super-block
scales) against the same values as fp32 fields, through the same kernel build in one
process: batch-1 q4 products on the 1.7B-class model's four weight shapes, distinct
buffers per layer (more than the caches hold), bf16 activations, alternating rounds.
Checks the outputs are identical, prints both layouts' bytes and the time ratio (median
and range; NOTES.md, section 50).

    python benchmarks/ab_compact_scales.py [--layers 12] [--rounds 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from passes.ops import quantized  # noqa: E402

SHAPES = ((6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # QKV, o, gate/up, down


def _compact(g: torch.Generator, n: int, groups: int, top: float, sign: int) -> torch.Tensor:
    sub = torch.randint(1, 64, (n, groups), dtype=torch.uint8, generator=g)
    sup = sign * (torch.rand(n, groups // 8, generator=g) * top / 63).half().float()
    return torch.cat([sub, sup.view(torch.uint8)], 1)


def main(argv: list[str] | None = None) -> float:
    """Runs the rounds; returns the median of (fp32 fields' time) / (compact time)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--scale", type=int, default=1, help="divide the shapes by this")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    compact, fp32 = [], []
    for _ in range(args.layers):
        for n, k in SHAPES:
            n, k = n // args.scale, k // args.scale
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            s, m = _compact(g, n, k // 32, 0.05, 1), _compact(g, n, k // 32, 0.4, -1)
            compact.append((w, s, m))
            fp32.append((w.clone(), quantized.expand_compact(s), quantized.expand_compact(m)))
    xs = {2 * w.shape[1]: torch.randn(1, 2 * w.shape[1], generator=g).bfloat16()
          for w, _, _ in compact}  # fmt: skip
    product = torch.ops.compilecore.q4_linear

    def run(layers: list) -> float:
        t0 = time.perf_counter()
        for w, s, m in layers:
            product(xs[2 * w.shape[1]], w, s, m, None, torch.float32)
        return time.perf_counter() - t0

    for a, b in zip(compact[:4], fp32[:4]):
        x = xs[2 * a[0].shape[1]]
        assert torch.equal(product(x, *a, None, torch.float32), product(x, *b, None, torch.float32))
    size = {name: sum(t.numel() * t.element_size() for f in fields for t in f) / 1e6
            for name, fields in (("compact", compact), ("fp32", fp32))}  # fmt: skip
    ratios = []
    for r in range(args.rounds):
        if r % 2:
            t_compact, t_fp32 = run(compact), run(fp32)
        else:
            t_fp32, t_compact = run(fp32), run(compact)
        ratios.append(t_fp32 / t_compact)
    median = statistics.median(ratios)
    print(f"{machine()['cpu_model']}, {args.layers} layers: compact {size['compact']:.0f} MB, "
          f"fp32 {size['fp32']:.0f} MB; fp32 time / compact time {median:.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}), outputs identical")  # fmt: skip
    return median


if __name__ == "__main__":
    main()
