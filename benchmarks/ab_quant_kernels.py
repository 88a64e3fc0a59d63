"""Same-process A/B of two builds of `passes/ops/quant_kernels.cpp`: the working tree's
against a git revision's, each running its own engine on the same GGUF file, batch-1
greedy decode measured in alternating rounds (the machine's speed moves within minutes:
only ratios within a round compare). Each engine records its CPU graph with its own
build, so the replays that are timed call only that build's functions.

    python benchmarks/ab_quant_kernels.py FILE.gguf --base HEAD~1 --rounds 6 --tokens 48
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_once, machine  # noqa: E402

from passes import (
    native,  # noqa: E402
    prefetch,
)
from passes.ops import quantized  # noqa: E402
from runtime import LLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "passes/ops/quant_kernels.cpp"


def git_show(revision: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{path}"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip


def revision_source(revision: str) -> tuple[str, object]:
    """(quant_kernels.cpp's text at `revision`, a reader of the files it includes there)."""
    return git_show(revision, SOURCE), lambda name: git_show(revision, f"passes/ops/{name}")


def build(text: str, name: str, read=None):
    """The kernel library built from `text` (its included files pasted in, read by
    `read`: the working tree's by default), as `_kernel` returns it."""
    flags = native.FLAGS + [f"-DCC_PREFETCH={prefetch.weight_prefetch_bytes()}"]
    source = native.op_source(text, read)
    lib = native.load_library(source, name, native.cache_root() / "ab", flags)
    quantized._kernel.cache_clear()
    real = quantized._kernel()  # the working tree's, with its argument types set
    for fn in ("q4_linear_team", "q4_linear_region", "q8_linear_team", "q8_linear_region",
               "dequantize_q4_region", "dequantize_q8_region"):  # fmt: skip
        getattr(lib, fn).argtypes = getattr(real, fn).argtypes
        getattr(lib, fn).restype = getattr(real, fn).restype
    return lib


def main(argv: list[str] | None = None) -> float:
    """Runs the A/B; returns the median ratio (working tree / base)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--base", default="HEAD~1", help="git revision of the other build")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--tokenizer", default=None, help="where the file's metadata has none")
    args = parser.parse_args(argv)
    base, read = revision_source(args.base)
    builds = {"base": build(base, "quant_ab_base", read),
              "tree": build((ROOT / SOURCE).read_text(), "quant_ab_tree")}  # fmt: skip
    original = quantized._kernel
    try:
        speeds = _rounds(args, builds)
    finally:
        quantized._kernel = original  # the process's own build again
    ratios = [t / b for t, b in zip(speeds["tree"], speeds["base"])]
    tree, base_speed = (statistics.median(speeds[n]) for n in ("tree", "base"))
    print(
        f"{Path(args.file).name}, {machine()['cpu_model']}: tree / {args.base} = "
        f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), tok/s "
        f"tree {tree:.2f}, base {base_speed:.2f}"
    )
    return statistics.median(ratios)


def _rounds(args: argparse.Namespace, builds: dict) -> dict[str, list[float]]:
    engines = {}
    for name, lib in builds.items():
        quantized._kernel = lambda lib=lib: lib  # what this engine's ops (and graph) call
        engines[name] = LLM(args.file, tokenizer=args.tokenizer, max_model_len=args.max_model_len)
        decode_once(engines[name], [1, 2, 3, 4], 8)  # compiles and records its graph
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            prompt = [5 + r, 17, 42, 99, 7 + len(name)]  # fresh each round
            quantized._kernel = lambda lib=builds[name]: lib  # an eager prefill's build
            speeds[name].append(decode_once(engines[name], prompt, args.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in speeds.items()))
    return speeds


if __name__ == "__main__":
    main()
