"""A 1.7B-class model for the benchmarks: random weights with SmolLM2-1.7B's shapes (24
layers, hidden 2048, MLP 8192, 32 heads, a 49152-token vocabulary, tied embeddings), the
default model's tokenizer, saved as a bf16 safetensors folder and converted with
llama.cpp's own tools (setup_peers.sh builds them) to BF16, Q8_0, Q4_1, Q4_K_M, Q5_K_M and
IQ4_XS GGUF files.

A 135M model partly fits in a large last-level cache; this one (3.4 GB in bf16, 1.1 GB
in Q4_1) does not, so its decode speed is the memory's.

    python benchmarks/make_1p7b.py        # -> <cache>/peers/random-1.7b{,-bf16,-q8_0,-q4_1...}
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402

SHAPES = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=49152, max_position_embeddings=8192,
    rope_theta=130000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip
NAME = "random-1.7b"


def folder() -> Path:
    return peers.peers_dir() / NAME


def gguf_file(outtype: str) -> Path:
    return peers.peers_dir() / f"{NAME}-{outtype}.gguf"


def make_folder() -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from models.default_model import ensure_default_model

    out = folder()
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(ensure_default_model())).save_pretrained(str(out))
    return out


def convert() -> None:
    src = next(peers.peers_dir().glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not gguf_file("bf16").is_file():
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder()),
                        "--outtype", "bf16", "--outfile", str(gguf_file("bf16"))],
                       check=True, env=env)  # fmt: skip
    quantize = peers.llama_tool("llama-quantize")
    for kind in ("Q8_0", "Q4_1", "Q4_K_M", "Q5_K_M", "IQ4_XS"):
        if not gguf_file(kind.lower()).is_file():
            subprocess.run([str(quantize), str(gguf_file("bf16")), str(gguf_file(kind.lower())),
                            kind], check=True, capture_output=True)  # fmt: skip


if __name__ == "__main__":
    if peers.llama_tool("llama-quantize") is None:
        sys.exit(f"llama-quantize is missing: build it with {peers.SETUP}")
    print(make_folder())
    convert()
    for kind in ("bf16", "q8_0", "q4_1", "q4_k_m", "q5_k_m", "iq4_xs"):
        print(gguf_file(kind))
