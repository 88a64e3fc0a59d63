"""Offline throughput: 64 requests with seeded prompt and output lengths uniform in
64-256, `ignore_eos`, this engine (continuous batching) against HF transformers' batched
`generate` (padded batches of --hf-batch), in one run. Only requested tokens count.

    python benchmarks/bench_throughput.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, save_results  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402


def workload(n: int, low: int, high: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]
    outputs = [rng.randint(low, high) for _ in range(n)]
    return prompts, outputs


def ours(llm: LLM, prompts, outputs) -> float:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == outputs
    return sum(outputs) / elapsed


def hf(model_dir: str, dtype, prompts, outputs, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk, lens = prompts[i : i + batch], outputs[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                pad_token_id=0,
            )
    return sum(outputs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.requests
    )
    vocab = llm.engine_config.model_config.hf_config.vocab_size
    prompts, outputs = workload(args.requests, args.min_len, args.max_len, vocab)
    rows = [{"engine": "compilecore compiled", "tok_s": ours(llm, prompts, outputs)}]
    model_dir, dtype = llm.engine_config.model_config.model, llm.engine_config.model_config.dtype
    llm.shutdown()
    del llm
    gc.collect()
    if not args.skip_hf:
        rows.append(
            {
                "engine": f"HF generate (batch {args.hf_batch})",
                "tok_s": hf(model_dir, dtype, prompts, outputs, args.hf_batch),
            }
        )
        for r in rows:
            r["vs_HF"] = r["tok_s"] / rows[-1]["tok_s"]
    title = (
        f"offline throughput, {args.requests} requests, lengths {args.min_len}-"
        f"{args.max_len}, {args.dtype}, {torch.get_num_threads()} threads"
    )
    return save_results(
        "throughput", rows, ["engine", "tok_s", "vs_HF"], title, Path(args.out), chart_key="tok_s"
    )


if __name__ == "__main__":
    main()
