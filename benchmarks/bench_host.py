"""Host time of a batch-1 decode step: the engine step's wall time minus the CPU-graph
replay inside it (scheduler, input writes, sampler, detokenizer, Python frames). One
request decodes `--steps` tokens per round, greedy (with `--sampled`: temperature 0.8,
top-p 0.95), EOS ignored (docs/kernel-choices.md, Host time).

    python benchmarks/bench_host.py [--model PATH] [--steps 256] [--rounds 4] [--sampled]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from compilecore import cpu_graph
from runtime import LLM, SamplingParams
from runtime.request import Request

sys.path.insert(0, str(Path(__file__).parent))
from common import GREEDY, RESULTS, SAMPLED, bf16_default, drawn, save_results  # noqa: E402

PROMPT = "Hello there, tell me a story about a dragon"


def measure(llm: LLM, steps: int, rounds: int, sampling: dict | None = None) -> list[dict]:
    replay_s = [0.0, 0]
    original = cpu_graph.CpuGraph.replay

    def timed(graph: cpu_graph.CpuGraph):
        start = time.perf_counter()
        out = original(graph)
        replay_s[0] += time.perf_counter() - start
        replay_s[1] += 1
        return out

    draw = sampling or GREEDY
    engine, params = llm.llm_engine, SamplingParams(max_tokens=steps + 1, ignore_eos=True, **draw)
    llm.generate([PROMPT], SamplingParams(max_tokens=8, **draw), use_tqdm=False)
    rows = []
    cpu_graph.CpuGraph.replay = timed
    try:
        for r in range(rounds):
            engine.add_request(Request(f"host-{r}", llm._tokenize(0, PROMPT), params))
            engine.step()  # the prefill
            replay_s[:] = [0.0, 0]
            done, start = 0, time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                done += 1
            wall = time.perf_counter() - start
            engine.release(f"host-{r}")
            rows.append({
                "round": r, "steps": done, "replays": replay_s[1],
                "step_ms": wall / done * 1e3, "replay_ms": replay_s[0] / done * 1e3,
                "host_ms": (wall - replay_s[0]) / done * 1e3,
            })  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        cpu_graph.CpuGraph.replay = original
    return rows


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sampled", action="store_true", help=f"sample ({SAMPLED})")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, **bf16_default(args.model)
    )
    sampling = SAMPLED if args.sampled else None
    rows = measure(llm, args.steps, args.rounds, sampling)
    title = (
        f"host time per batch-1 decode step (outside the CPU-graph replay), "
        f"{drawn(sampling)}, {args.dtype}"
    )
    columns = ["round", "steps", "replays", "step_ms", "replay_ms", "host_ms"]
    name = "host_sampled" if args.sampled else "host"
    return save_results(name, rows, columns, title, Path(args.out))


if __name__ == "__main__":
    main()
