"""Perplexity of a GGUF file over a fixed public-domain text (tests/data/public_domain.txt),
computed the way `llama-perplexity` computes it, and side by side with that tool on the
same file when setup_peers.sh has built it.

llama-perplexity's method, reproduced: the text is tokenized once (BOS only where the
vocabulary adds one), cut into chunks of `n_ctx` tokens, and each chunk is scored from
its middle: the tokens after position n_ctx / 2 given everything before them in the chunk.
Ours scores the same tokens through `prompt_logprobs` (the prompt's own log-probabilities,
vLLM's field), with the prefix cache off so no chunk reads another's KV.

    python benchmarks/perplexity.py [--model FILE.gguf] [--ctx 128]
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from pathlib import Path

TEXT = Path(__file__).parent.parent / "tests" / "data" / "public_domain.txt"


def chunks(token_ids: list[int], n_ctx: int) -> list[list[int]]:
    return [token_ids[i : i + n_ctx] for i in range(0, len(token_ids) - n_ctx + 1, n_ctx)]


def perplexity(llm, token_ids: list[int], n_ctx: int) -> float:
    """exp(mean NLL) of each chunk's second-half tokens, as llama-perplexity scores them."""
    from runtime import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    nll, count = 0.0, 0
    for chunk in chunks(token_ids, n_ctx):
        out = llm.generate([chunk], params, use_tqdm=False)[0]
        for i in range(n_ctx // 2 + 1, n_ctx):  # predicted from position i - 1
            nll -= out.prompt_logprobs[i][chunk[i]].logprob
            count += 1
    if count == 0:
        raise ValueError(f"the text has fewer than {n_ctx} tokens: nothing to score")
    return math.exp(nll / count)


def text_tokens(llm) -> list[int]:
    return llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)


def llama_perplexity(path: Path, n_ctx: int, threads: int) -> float | None:
    sys.path.insert(0, str(Path(__file__).parent))
    import peers

    tool = peers.llama_tool("llama-perplexity")
    if tool is None:
        peers.report_missing(["llama-perplexity"])
        return None
    cmd = [str(tool), "-m", str(path), "-f", str(TEXT), "-c", str(n_ctx), "-b", str(n_ctx),
           "-t", str(threads)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", res.stdout + res.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity gave no estimate:\n{res.stderr[-2000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> None:
    import torch

    from models.default_model import find_gguf
    from runtime import LLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the shipped one)")
    parser.add_argument("--ctx", type=int, default=128)
    args = parser.parse_args(argv)
    path = Path(args.model) if args.model else find_gguf()
    results = {}
    exact = {"compilation_config": {"passes": {"int8_activations": False}}}
    for name, kwargs in (("compilecore (bf16, blocks)", {}),
                         ("compilecore (bf16, blocks, exact products)", exact),
                         ("compilecore (fp32, eager)", {"dtype": "float32",
                                                        "enforce_eager": True})):  # fmt: skip
        llm = LLM(str(path), enable_prefix_caching=False, max_model_len=args.ctx + 8, **kwargs)
        results[name] = perplexity(llm, text_tokens(llm), args.ctx)
        del llm
    peer = llama_perplexity(path, args.ctx, torch.get_num_threads())
    if peer is not None:
        results["llama-perplexity"] = peer
    print(f"perplexity of {path.name}, {TEXT.name}, chunks of {args.ctx}:")
    for name, value in results.items():
        ratio = f" ({value / peer:.4f}x llama-perplexity)" if peer and "llama" not in name else ""
        print(f"  {name}: {value:.4f}{ratio}")


if __name__ == "__main__":
    main()
