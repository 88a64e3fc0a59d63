"""Speculative decoding (n-gram lookup, or a draft model) against plain decoding, batch 1,
interleaved.

    python benchmarks/bench_spec.py [--model PATH] [--rounds 3] [--tokens 128] [--k 3 5]
                                    [--draft PATH [--draft-only]]

`--draft`: also a draft model (same tokenizer) proposing k tokens; e.g. the 135M model's
bf16 GGUF drafted by its shipped Q4_1 file (the same model at a third of the bytes), or a
random-weight 1.7B-class target drafted by the 135M, where only never-slower means anything.

Three prompts through the chat template: a code edit (rename a variable in a given
function), a copy of a given paragraph (input-grounded: lookups find what the answer
quotes) and a free one. Per round and configuration, a fresh
request (prefix caching off: each round computes its whole prompt) is decoded greedily.
Prints tok/s medians and ranges, each configuration over plain decoding in the same
round, the acceptance, a verification step's time in plain decode steps (medians), and
whether the tokens equal plain decoding's. On a GGUF file, llama.cpp's own n-gram lookup
(`llama-lookup`, setup_peers.sh) on the same file and templated prompt, each k, in the same
rounds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
from common import machine  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402

GROUNDED = (
    "Rewrite this paragraph with every sentence kept, in the same words:\n\n"
    "The compiler traces the model once with a dynamic token dimension. Its passes fuse "
    "the residual add with the RMSNorm that follows, and the rotary embedding with the "
    "QKV projection. The graph is cut at attention, which stays a custom op, and each "
    "piece is captured as a graph per batch size. The runtime schedules requests in "
    "continuous batches under a token budget, and a long prompt is prefilled in chunks."
)
CODE = (
    "In this Python function rename the variable `total` to `running_sum` and give back the "
    "whole function, every other line unchanged:\n\n"
    "def mean_of_positive(values):\n"
    "    total = 0.0\n"
    "    count = 0\n"
    "    for value in values:\n"
    "        if value is None:\n"
    "            continue\n"
    "        if value > 0:\n"
    "            total += value\n"
    "            count += 1\n"
    "    if count == 0:\n"
    "        return 0.0\n"
    "    return total / count\n"
)
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run(llm: LLM, prompt: str, tokens: int) -> tuple[float, list[int], object]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    return len(out.outputs[0].token_ids) / seconds, out.outputs[0].token_ids, out.metrics


def llama_lookup(path: str, prompt: str, tokens: int, k: int) -> tuple[float, float]:
    """llama.cpp's n-gram lookup decoding (`llama-lookup`: greedy, EOS ignored, 2 threads)
    of `tokens` after the templated `prompt` on the same GGUF file: (tok/s over its prompt
    and decode, as ours is timed; the share of drafts accepted)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        cmd = [str(peers.llama_tool("llama-lookup")), "-m", path, "-f", f.name, "-n",
               str(tokens), "--temp", "0", "-t", "2", "--spec-draft-n-max", str(k),
               "--ignore-eos"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    timed = re.findall(r"(en|de)coded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    accept = re.search(r"accept\s+=\s+([\d.]+)%", text)
    if len(timed) != 2 or accept is None:
        raise RuntimeError(f"llama-lookup gave no timings (exit {out.returncode}):\n{text[-2000:]}")
    decoded = int(next(n for kind, n, _ in timed if kind == "de"))
    return decoded / sum(float(t) for _, _, t in timed), float(accept[1]) / 100


def _time_steps(llm: LLM) -> None:
    """Record each decode-only step's milliseconds in `llm.step_ms`, split by whether it
    verified drafts: the cost a verification has in plain steps."""
    engine = llm.llm_engine
    run_step = engine._run

    def timed(out):
        start = time.perf_counter()
        finished = run_step(out)
        if all(s.num_new_tokens - len(s.drafts) == 1 for s in out.scheduled):
            drafted = any(s.drafts for s in out.scheduled)
            llm.step_ms[drafted].append((time.perf_counter() - start) * 1e3)
        return finished

    engine._run = timed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--draft", default=None, help="a draft model's path (GGUF or folder)")
    ap.add_argument("--draft-only", action="store_true", help="no n-gram configurations")
    ap.add_argument("--no-llama-cpp", action="store_true", help="no llama-lookup rows")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engines' max_model_len (a 1.7B-class model's 8192 default does "
                    "not fit the default KV budget)")  # fmt: skip
    ap.add_argument("--floor", type=float, default=None,
                    help="min_tokens_per_verification (default: the engine's)")  # fmt: skip
    args = ap.parse_args(argv)
    configs = {"plain": None}
    for k in args.k:
        if not args.draft_only:
            configs[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k,
                                       "min_tokens_per_verification": args.floor}  # fmt: skip
        if args.draft:
            configs[f"draft k={k}"] = {"model": args.draft, "num_speculative_tokens": k}
    # No prefix cache: every round computes its whole prompt, as the first did.
    llms = {name: LLM(args.model, speculative_config=spec, enable_prefix_caching=False,
                      max_model_len=args.max_model_len)
            for name, spec in configs.items()}  # fmt: skip
    for llm in llms.values():
        llm.step_ms = {False: [], True: []}  # decode-only steps' times, by drafts in them
        _time_steps(llm)
    print(
        f"{machine()}; batch 1, {args.tokens} greedy tokens, {args.rounds} rounds; "
        f"model {args.model or 'default'}, draft {args.draft}"
    )
    workloads = (("code", CODE), ("grounded", GROUNDED), ("free", FREE))
    # Before round 0: the CPU graph of every verification size (a step of b decodes records
    # and checks the graph a verification of b tokens replays), then each workload once.
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in llms.values():
        for b in range(1, max(args.k) + 2):
            llm.generate([[1, 2, 3]] * b, warm, use_tqdm=False)
        for _, text in workloads:
            run(llm, f"(warm-up) {text}", args.tokens)
    for llm in llms.values():
        llm.step_ms = {False: [], True: []}
    # llama.cpp's lookup on the same file and templated prompt, where the model is a GGUF
    # file and setup_peers.sh built the tool.
    path = str(llms["plain"].engine_config.model_config.model)
    lookup = not args.no_llama_cpp and path.endswith(".gguf") and not args.draft_only
    if lookup and peers.llama_tool("llama-lookup") is None:
        peers.report_missing(["llama-lookup"])
        lookup = False
    for label, text in workloads:
        speeds = {name: [] for name in llms}
        theirs: dict[int, list[float]] = {}
        theirs_rate: dict[int, float] = {}
        ratios = {name: [] for name in llms}
        same, accept = {name: True for name in llms}, {}
        for r in range(args.rounds):
            prompt = f"(round {r}) {text}"
            plain_speed, plain_tokens, _ = run(llms["plain"], prompt, args.tokens)
            speeds["plain"].append(plain_speed)
            for name, llm in llms.items():
                if name == "plain":
                    continue
                speed, tokens, m = run(llm, prompt, args.tokens)
                speeds[name].append(speed)
                ratios[name].append(speed / plain_speed)
                same[name] &= tokens == plain_tokens
                accept[name] = (m.acceptance_rate, m.mean_acceptance_length)
            for k in args.k if lookup else ():
                chat = [{"role": "user", "content": prompt}]
                templated = llms["plain"].get_tokenizer().apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=True)  # fmt: skip
                speed, rate = llama_lookup(path, templated, args.tokens, k)
                theirs.setdefault(k, []).append(speed)
                theirs_rate[k] = rate
        for name in llms:
            s = speeds[name]
            line = f"{label:8s} {name:10s} {statistics.median(s):6.1f} tok/s "
            line += f"({min(s):.1f}-{max(s):.1f})"
            if name != "plain":
                q = ratios[name]
                rate, length = accept[name]
                times = llms[name].step_ms
                # in plain decoding's steps (every step verifies with a draft model)
                plain_ms = statistics.median(llms["plain"].step_ms[False])
                cost = (f"{statistics.median(times[True]) / plain_ms:.1f} steps"
                        if times[True] else "none run")  # fmt: skip
                line += (f"  {statistics.median(q):.2f}x ({min(q):.2f}-{max(q):.2f})"
                         f"  a verification {cost}"
                         f"  accepted {rate or 0:.0%}, {length or 1:.2f} tokens/step"
                         f"  tokens equal: {same[name]}")  # fmt: skip
            print(line, flush=True)
        for k, t in theirs.items():
            ours = statistics.median(speeds[f"ngram k={k}"])
            print(f"{label:8s} {'llama-lookup k=' + str(k):10s} {statistics.median(t):6.1f} tok/s "
                  f"({min(t):.1f}-{max(t):.1f})  accepted {theirs_rate[k]:.0%}; ngram k={k} "
                  f"over it {ours / statistics.median(t):.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
