"""The K-quants' scales as stored (compact: sub-block bytes and fp32 super-block scales)
against the same values as fp32 fields, through the same kernel build in one process:
batch-1 products on the 1.7B-class model's weight shapes (Q4_K: its four linear shapes;
Q6_K: the Q4_K_M mix's v and down projections and the head), distinct buffers per layer
(more than the caches hold), bf16 activations, alternating rounds. Checks the outputs are
identical, prints both layouts' bytes and the time ratio (median and range; NOTES.md,
sections 50 and 51).

    python benchmarks/ab_compact_scales.py [--format q4_k|q6_k] [--layers 12] [--rounds 16]
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

SHAPES = {
    "q4_k": ((6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)),  # QKV, o, gate/up, down
    "q6_k": ((2048, 2048), (2048, 8192)),  # v, down (half the layers; the head once, below)
}


def _compact(g: torch.Generator, n: int, groups: int, top: float, sign: int) -> torch.Tensor:
    sub = torch.randint(1, 64, (n, groups), dtype=torch.uint8, generator=g)
    sup = sign * (torch.rand(n, groups // 8, generator=g) * top / 63).half().float()
    return torch.cat([sub, sup.view(torch.uint8)], 1)


def _compact6(g: torch.Generator, n: int, groups: int, top: float) -> torch.Tensor:
    sub = torch.randint(-128, 128, (n, groups), dtype=torch.int8, generator=g)
    sup = (torch.rand(n, groups // 16, generator=g) * top / 127).half().float()
    return torch.cat([sub, sup.view(torch.int8)], 1)


def _layer(g: torch.Generator, fmt: str, n: int, k: int) -> tuple[tuple, tuple]:
    """(compact fields, the same values as fp32 fields) of one weight."""
    if fmt == "q6_k":
        w = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
        s = _compact6(g, n, k // 16, 0.04)
        return (w, s), (w.clone(), quantized.expand_compact(s))
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s, m = _compact(g, n, k // 32, 0.05, 1), _compact(g, n, k // 32, 0.4, -1)
    return (w, s, m), (w.clone(), quantized.expand_compact(s), quantized.expand_compact(m))


def main(argv: list[str] | None = None) -> float:
    """Runs the rounds; returns the median of (fp32 fields' time) / (compact time)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--scale", type=int, default=1, help="divide the shapes by this")
    parser.add_argument("--format", choices=sorted(SHAPES), default="q4_k")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(args.layers) for shape in SHAPES[args.format]]
    if args.format == "q6_k":
        shapes.append((49152, 2048))  # the head
    compact, fp32 = [], []
    for n, k in shapes:
        a, b = _layer(g, args.format, n // args.scale, k // args.scale)
        compact.append(a)
        fp32.append(b)
    q4 = args.format == "q4_k"
    cols = {f[0].shape[1] * (2 if q4 else 1) for f in compact}
    xs = {k: torch.randn(1, k, generator=g).bfloat16() for k in cols}
    product = torch.ops.compilecore.q4_linear if q4 else torch.ops.compilecore.q8_linear

    def x_for(fields: tuple) -> torch.Tensor:
        return xs[fields[0].shape[1] * (2 if q4 else 1)]

    def run(layers: list) -> float:
        t0 = time.perf_counter()
        for fields in layers:
            product(x_for(fields), *fields, None, torch.float32)
        return time.perf_counter() - t0

    for a, b in zip(compact[:4], fp32[:4]):
        want = product(x_for(b), *b, None, torch.float32)
        assert torch.equal(product(x_for(a), *a, None, torch.float32), want)
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
    print(f"{machine()['cpu_model']}, {args.format}, {args.layers} layers: compact "
          f"{size['compact']:.0f} MB, "
          f"fp32 {size['fp32']:.0f} MB; fp32 time / compact time {median:.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}), outputs identical")  # fmt: skip
    return median


if __name__ == "__main__":
    main()
