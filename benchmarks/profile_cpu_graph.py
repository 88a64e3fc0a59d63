"""Where a recorded decode step's time goes, call by call: the batch-1 CPU graph of a
model (the default model if none), each call timed inside the replay
(`CpuGraph.profile`), summed by what recorded it.

    python benchmarks/profile_cpu_graph.py                       # the default model
    python benchmarks/profile_cpu_graph.py --model x.gguf --batch 4 --top 12
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import PROMPT_37, machine  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--top", type=int, default=10, help="the slowest calls to list")
    args = parser.parse_args(argv)
    llm = LLM(args.model, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([PROMPT_37] * args.batch, params, use_tqdm=False)  # records the graph
    graph = llm.llm_engine.runner.cpu_graphs.get(args.batch)
    if graph is None:
        raise SystemExit(f"no CPU graph recorded at batch {args.batch}")
    rows = graph.profile(args.replays)
    total = sum(us for _, us in rows)
    by_what: dict[str, list[float]] = defaultdict(list)
    for info, us in rows:
        what = "Inductor kernels" if info.what.startswith("Inductor") else info.what
        by_what[what].append(us)
    cpu = machine().get("cpu")
    print(f"{cpu}; {graph!r}, batch {args.batch}: {total:.0f} us a step, median of "
          f"{args.replays} replays")  # fmt: skip
    print("| recorded by | calls | us a step | share |\n|---|---|---|---|")
    for what, times in sorted(by_what.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {what} | {len(times)} | {sum(times):.0f} | {sum(times) / total:.0%} |")
    print(f"\nThe {args.top} slowest calls:")
    for info, us in sorted(rows, key=lambda r: -r[1])[: args.top]:
        print(f"  {us:7.1f} us  {info.what} <- {info.source}  ({', '.join(info.shapes)})")
    return {"total_us": total, "by_what": {k: sum(v) for k, v in by_what.items()}}


if __name__ == "__main__":
    main()
