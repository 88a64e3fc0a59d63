"""Run the engine under torchrun, on one machine or several:

    torchrun --nproc-per-node 2 -m runtime.launch --tensor-parallel-size 2 \\
        --model path/to/model "What is the capital of France?"

    torchrun --nnodes 2 --node-rank N --master-addr HOST --nproc-per-node 4 \\
        -m runtime.launch --tensor-parallel-size 4 --pipeline-parallel-size 2 ...

Global rank 0 is the driver: it builds the `LLM`, generates and prints; every other rank
builds its shard and follows the driver's plans until it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from runtime.executor import run_worker
from runtime.llm import LLM, build_engine_config
from runtime.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="runtime.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt", nargs="+")
    parser.add_argument("--model", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--json", action="store_true", help="print token ids as JSON lines")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    engine_args = dict(
        dtype=args.dtype,
        enforce_eager=args.eager,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )
    if rank != 0:
        run_worker(build_engine_config(args.model, **engine_args), rank, world, "env://")
        return 0
    llm = LLM(args.model, distributed_executor_backend="external", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.json)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        if args.json:
            print(json.dumps(out.outputs[0].token_ids))
        else:
            print(out.outputs[0].text)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
