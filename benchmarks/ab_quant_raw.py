"""Same-process A/B of two builds of `passes/ops/quant_kernels.cpp` on its products alone:
the working tree's against a git revision's, `q4_linear_region` / `q8_linear_region`
called through ctypes on random blocks (q4, Q4_K, Q5_K, Q6_K, Q8_0, IQ4) held in huge pages
(as the engine holds weights),
alternating rounds. Prints each build's time per call, the ratio base / tree (median and
range) and each build's largest error against an fp64 product (docs/kernel-choices.md, Strips).

    python benchmarks/ab_quant_raw.py --base 3534c06 --format q8 --rows 1,16,64 \
        --shapes 1536x576,576x1536,960x576
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ab_quant_kernels import ROOT, SOURCE, build, revision_source  # noqa: E402
from common import machine  # noqa: E402

from passes.huge_pages import huge_page_buffer  # noqa: E402
from passes.ops import quantized  # noqa: E402


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into huge pages."""
    nbytes = t.numel() * t.element_size()
    out = huge_page_buffer(nbytes)[0][:nbytes].view(t.dtype).view(t.shape)
    return out.copy_(t)


def weights(fmt: str, shapes: list[tuple[int, int]], group: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in shapes:
        if fmt == "q5_k":  # values in 5 bits, as the loader packs them
            w = quantized.pack_q5(torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g))
        elif fmt.startswith(("q4", "iq4")):  # IQ4: table indices in q4's order
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        elif fmt == "q6_k":  # values in 6 bits, as the loader packs them
            w = quantized.pack_q6(torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g))
        else:
            w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        if fmt == "iq4":  # fp32 scales: an fp16 times an integer in [-32, 31]
            sub = torch.randint(-32, 32, (n, k // 32), generator=g).float()
            scales, mins = (torch.rand(n, k // 32, generator=g) * 0.01).half().float() * sub, None
        elif fmt == "q6_k":  # compact: int8 sub-block scales, an fp32 scale per 16 groups
            sub = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=g)
            sup = (torch.rand(n, k // 256, generator=g) * 0.04 / 127).half().float()
            scales, mins = torch.cat([sub, sup.view(torch.int8)], 1), None
        elif fmt in ("q4_k", "q5_k"):  # compact: 6-bit sub-block bytes, fp32 a super-block
            scales, mins = (compact(g, n, k // group, top, sign)
                            for top, sign in ((0.05, 1), (0.4, -1)))  # fmt: skip
        else:
            scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
            mins = (torch.rand(n, k // group, generator=g) * -0.05).half() if fmt == "q4" else None
        out.append((n, k, pinned(w), pinned(scales), None if mins is None else pinned(mins)))
    return out


def compact(g: torch.Generator, n: int, groups: int, top: float, sign: int) -> torch.Tensor:
    """Q4_K's scales (or mins) as the loader keeps them (quant/formats.h `CompactPtr`)."""
    sub = torch.randint(0, 64, (n, groups), dtype=torch.uint8, generator=g)
    sup = sign * (torch.rand(n, groups // 8, generator=g) * top / 63).half().float()
    return torch.cat([sub, sup.view(torch.uint8)], 1)


def call(lib, fmt: str, x: list[torch.Tensor], ws: list, ys: list[torch.Tensor], group: int,
         extra_flags: int = 0):  # fmt: skip
    for (n, k, w, s, mn), xi, y in zip(ws, x, ys):
        m, flags = xi.shape[0], 1 | extra_flags  # bf16 x, fp32 y, fp16 scales
        if fmt in ("q4_k", "q5_k"):
            flags |= 16 | (64 if fmt == "q5_k" else 0)  # compact; Q5_K's 5-bit rows
        if fmt == "q6_k":
            flags |= 16 | 64  # compact scales, values in 6 bits
            group = 16
        if fmt == "iq4":
            flags |= 4 | 256  # fp32 scales, table indices
        if fmt.startswith(("q4", "q5")):
            lib.q4_linear_region(xi.data_ptr(), flags, w.data_ptr(), s.data_ptr(),
                                 mn.data_ptr(), 0, y.data_ptr(), m, n, k, group,
                                 torch.get_num_threads())  # fmt: skip
        else:
            lib.q8_linear_region(xi.data_ptr(), flags, w.data_ptr(), s.data_ptr(), 0,
                                 y.data_ptr(), m, n, k, group, torch.get_num_threads())  # fmt: skip


def reference(fmt: str, x: torch.Tensor, w: tuple) -> torch.Tensor:
    n, k, qw, s, mn = w
    if fmt.startswith(("q4", "q5")):
        values = quantized.dequantize_q4_ref(qw, s, mn, torch.float64)
    else:
        values = quantized.dequantize_q8_ref(qw, s, torch.float64)
    return x.double() @ values.T


def main(argv: list[str] | None = None) -> dict[int, float]:
    """Runs the A/B; returns the median ratio (base time / tree time) per row count."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="git revision of the other build")
    parser.add_argument("--format", default="q8",
                        choices=["q4", "q4_k", "q5_k", "q6_k", "q8", "iq4"])  # fmt: skip
    parser.add_argument("--shapes", default="1536x576,576x1536,960x576", help="NxK,...")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--flags", type=int, default=0, help="flag bits added to every call "
                        "(32: Q8_0's strips may quantize activations)")  # fmt: skip
    parser.add_argument("--ms", type=float, default=50.0, help="time a round aims at")
    args = parser.parse_args(argv)
    base, read = revision_source(args.base)
    libs = {"base": build(base, "quant_raw_base", read),
            "tree": build((ROOT / SOURCE).read_text(), "quant_raw_tree")}  # fmt: skip
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ws = weights(args.format, shapes, args.group)
    print(f"{args.format}, groups of {args.group}, shapes {args.shapes}, base {args.base}, "
          f"{machine()['cpu_model']}, {torch.get_num_threads()} threads")  # fmt: skip
    ratios = {}
    for m in (int(r) for r in args.rows.split(",")):
        x = [torch.randn(m, k).bfloat16() for _, k, *_ in ws]
        ys = {name: [torch.empty(m, n) for n, *_ in ws] for name in libs}
        errors = {}
        for name, lib in libs.items():
            call(lib, args.format, x, ws, ys[name], args.group, args.flags)
            errors[name] = max(((y.double() - want).abs().max() / want.abs().max()).item()
                               for y, want in zip(ys[name], (reference(args.format, xi, w)
                                                             for xi, w in zip(x, ws))))  # fmt: skip
        start = time.perf_counter()
        call(libs["tree"], args.format, x, ws, ys["tree"], args.group, args.flags)
        reps = max(1, int(args.ms / 1e3 / (time.perf_counter() - start)))
        times: dict[str, list[float]] = {name: [] for name in libs}
        for r in range(args.rounds):
            for name in list(libs) if r % 2 else list(libs)[::-1]:
                start = time.perf_counter()
                for _ in range(reps):
                    call(libs[name], args.format, x, ws, ys[name], args.group, args.flags)
                times[name].append((time.perf_counter() - start) / reps)
        per = sorted(b / t for b, t in zip(times["base"], times["tree"]))
        ratios[m] = statistics.median(per)
        print(f"{m} rows: base {statistics.median(times['base']) * 1e3:.3f} ms, tree "
              f"{statistics.median(times['tree']) * 1e3:.3f} ms, base / tree {ratios[m]:.2f}x "
              f"({per[0]:.2f}-{per[-1]:.2f}); largest error / largest output: base "
              f"{errors['base']:.1e}, tree {errors['tree']:.1e}")  # fmt: skip
    return ratios


if __name__ == "__main__":
    main()
