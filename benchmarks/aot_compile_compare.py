"""Forward recipes vs torch's own AOT compile (`torch.compile(...).aot_compile(...)`,
`save_compiled_function`, `torch.compiler.load_compiled_function`): warm-start time and
per-call host time, each phase in a fresh process.

    python benchmarks/aot_compile_compare.py [--layers 4] [--calls 300] [--models host]
        [--jobs 1]

Both variants compile the same random-weight Llama (the default model's shapes, fewer
layers, bf16) and run it with dense attention:
- recipe: our `support_torch_compile` (piecewise, per-piece Inductor, forward recipe);
- recipe-whole: the same with `splitting_ops=[]`, one graph like the AOT variant's;
- aot: the eager module's forward through `torch.compile(fullgraph=True)` with Inductor,
  AOT-compiled, saved and loaded (one graph: torch's AOT path has no piecewise split).
`first_call_s` is the time from a built model to the first forward's output in a fresh
process with everything cached (warm start); `host_us` is the median time of a 1-token
call on a 1-layer model of width 64, where kernels take microseconds and the rest is the
per-call machinery (recipe dispatch vs AOT guard check and bytecode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _model(variant: str, layers: int, width: int, cache: str):
    import torch
    from transformers import LlamaConfig

    from compilecore.config import CompilationConfig
    from runtime.testing import _model as build

    hf = LlamaConfig(
        vocab_size=49152 if width > 64 else 320, hidden_size=width,
        intermediate_size=width * 8 // 3 if width > 64 else 128, num_hidden_layers=layers,
        num_attention_heads=width // 64 if width > 64 else 4,
        num_key_value_heads=3 if width > 64 else 2, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip
    if variant.startswith("recipe"):
        whole = {"splitting_ops": []} if variant == "recipe-whole" else {}
        cc = CompilationConfig(cache_dir=cache, compile_sizes=[], cpu_graphs=False, **whole)
    else:
        cc = CompilationConfig(mode="none")
    dtype = torch.bfloat16 if width > 64 else torch.float32
    model, config = build(hf, dtype, cc)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model, config


def forward(model, input_ids, positions):
    return model(input_ids, positions)


def child(variant: str, phase: str, layers: int, width: int, cache: str, calls: int) -> dict:
    import torch

    from compilecore.forward_context import set_forward_context
    from runtime.attention import AttentionMetadata

    torch.set_num_threads(2)
    model, config = _model(variant, layers, width, cache)
    ids, pos = torch.tensor([5, 6, 7, 8]), torch.arange(4)
    path = Path(cache) / "aot_forward.bin"

    def run(fn, n: int):
        with set_forward_context(AttentionMetadata.dense([n]), config), torch.inference_mode():
            return fn(model, ids[:n], pos[:n])

    start = time.perf_counter()
    if variant.startswith("recipe"):
        fn = forward
    elif phase == "cold":
        torch._dynamo.decorators.mark_unbacked(ids, 0)
        torch._dynamo.decorators.mark_unbacked(pos, 0)
        compiled = torch.compile(forward, fullgraph=True, backend="inductor")
        with set_forward_context(AttentionMetadata.dense([4]), config), torch.inference_mode():
            fn = compiled.aot_compile(((model, ids, pos), {}))
        fn.save_compiled_function(str(path))
    else:
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f, f_globals=globals())
    run(fn, 4)
    first = time.perf_counter() - start
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        run(fn, 1)
        times.append(time.perf_counter() - t0)
    return {"first_call_s": first, "call_us": statistics.median(times) * 1e6}


def aot_missing() -> str | None:
    """Why this torch cannot run the aot variant (None when it can): the AOT-compile API
    appeared after torch 2.11, which the project also supports."""
    import torch

    if not hasattr(torch.compile(forward), "aot_compile") or not hasattr(
        torch.compiler, "load_compiled_function"
    ):
        return f"torch {torch.__version__} has no torch.compile(...).aot_compile"
    return None


def _spawn(*args: str) -> dict:
    res = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=ROOT
    )
    if res.returncode != 0:
        tail = res.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"error": tail[0][:300]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=576, help="warm-start model hidden size")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--models", default="warm start,host",
                        help="which rows per variant, comma-separated")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1,
                        help="rows measured side by side (their timings then share the cores: "
                        "for smoke runs only)")  # fmt: skip
    parser.add_argument("--child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, phase, layers, width, cache, calls = args.child
        print(json.dumps(child(variant, phase, int(layers), int(width), cache, int(calls))))
        return []
    models = {"warm start": (args.layers, args.width), "host": (1, 64)}
    chosen = args.models.split(",")
    if unknown := [m for m in chosen if m not in models]:
        parser.error(f"--models: unknown {unknown}; choose from {list(models)}")

    missing = aot_missing()

    def measure(variant: str, label: str) -> dict:
        layers, width = models[label]
        if variant == "aot" and missing:
            row = {"variant": variant, "model": label, "skipped": missing}
            print(json.dumps(row), flush=True)
            return row
        with tempfile.TemporaryDirectory() as cache:
            common = (str(layers), str(width), cache, str(args.calls))
            cold = _spawn(variant, "cold", *common)
            warm = _spawn(variant, "warm", *common)
        row = {"variant": variant, "model": label, "cold": cold, "warm": warm}
        print(json.dumps(row), flush=True)
        return row

    todo = [(v, label) for v in ("recipe", "recipe-whole", "aot") for label in chosen]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda job: measure(*job), todo))
    print("\n| variant | model | cold first call s | warm first call s | warm call us |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['variant']} | {r['model']} | not measured: {r['skipped']} | |")
            continue
        c, w = r["cold"], r["warm"]
        if "error" in c or "error" in w:
            errors = f"{c.get('error', '')} | {w.get('error', '')}"
            print(f"| {r['variant']} | {r['model']} | {errors} | |")
            continue
        print(
            f"| {r['variant']} | {r['model']} | {c['first_call_s']:.2f} | "
            f"{w['first_call_s']:.2f} | {w['call_us']:.0f} |"
        )
    return rows


if __name__ == "__main__":
    main()
