"""Start-up: a cold compile (empty compile caches, Inductor's included), a warm start
(compile cache hit), each in a fresh process, and the time to first token for a 37-token
prompt once the engine is up.

    python benchmarks/bench_startup.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, save_results  # noqa: E402

CHILD = """
import json, sys, time
start = time.perf_counter()
from runtime import LLM, SamplingParams
from compilecore.counters import compilation_counter as c
model = sys.argv[1] if sys.argv[1] != "-" else None
llm = LLM(model, dtype=sys.argv[2], max_model_len=int(sys.argv[4]), kv_cache_memory=64 << 20,
          compilation_config={"cache_dir": sys.argv[3]})
ready = time.perf_counter()
prompt = list(range(100, 137))
p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([prompt], p, use_tqdm=False)
first = time.perf_counter()  # the first token, taken when it exists
t = time.perf_counter(); llm.generate([prompt[::-1]], p, use_tqdm=False)
print(json.dumps({"engine_ready_s": ready - start, "first_token_s": first - start,
                  "ttft_37_ms": (time.perf_counter() - t) * 1e3,
                  "inductor_compiles": c.num_inductor_compiles, "cache_hits": c.num_cache_hits}))
"""


def run(model: str | None, dtype: str, cache: str, max_len: int, env: dict) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", CHILD, model or "-", dtype, cache, str(max_len)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        start = time.perf_counter()
        cache = str(Path(tmp) / "cc")
        cold = run(args.model, args.dtype, cache, args.max_model_len, env)
        warm = run(args.model, args.dtype, cache, args.max_model_len, env)
        print(f"both runs took {time.perf_counter() - start:.1f} s")
    rows = [{"start": "cold (empty caches)", **cold}, {"start": "warm (cache hit)", **warm}]
    title = f"start-up from process start, {args.dtype}"
    columns = [
        "start",
        "engine_ready_s",
        "first_token_s",
        "ttft_37_ms",
        "inductor_compiles",
        "cache_hits",
    ]
    return save_results("startup", rows, columns, title, Path(args.out))


if __name__ == "__main__":
    main()
