"""GPU: batch-1 decode of a 1B-class Llama (random weights, built here) with CUDA graphs
against eager, and the achieved bandwidth against a device-to-device copy.

    python benchmarks/bench_gpu.py --out DIR
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, copy_bandwidth, decode_speed, save_results, weight_bytes  # noqa: E402
from gpu_check import build_checkpoint  # noqa: E402

from runtime import LLM  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp), big=True, device="cuda")
        for name, kwargs in (("eager", {"enforce_eager": True}), ("compiled + CUDA graphs", {})):
            llm = LLM(tmp, dtype="bfloat16", max_model_len=2048, **kwargs)
            speed = decode_speed(llm, list(range(100, 137)), args.tokens, 3)
            gbs = weight_bytes(llm) * speed / 1e9
            rows.append(
                {"engine": name, "tok_s": speed, "GB_s": gbs, "of_copy_bw": gbs / bandwidth}
            )
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    rows[1]["vs_eager"] = rows[1]["tok_s"] / rows[0]["tok_s"]
    title = f"1B Llama batch-1 decode on {torch.cuda.get_device_name(0)}, copy {bandwidth:.0f} GB/s"
    return save_results(
        "gpu", rows, ["engine", "tok_s", "vs_eager", "GB_s", "of_copy_bw"], title, Path(args.out)
    )


if __name__ == "__main__":
    main()
