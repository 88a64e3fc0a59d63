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

from runtime import LLM  # noqa: E402


def build_1b(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(folder))


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
        build_1b(Path(tmp))
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
