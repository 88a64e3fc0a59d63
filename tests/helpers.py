"""Small real checkpoints and tokenizers for tests: built with transformers and
tokenizers, saved with `save_pretrained`, loaded back through our loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from compilecore.config import CompilationConfig, EngineConfig
from compilecore.forward_context import set_forward_context
from models.loader import load_hf_config, load_model
from runtime.attention import AttentionMetadata, DenseAttentionBackend

TOKENIZER_VOCAB = 320
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Compilers turn programs into faster programs; graphs are cut at attention.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "héllo wörld, naïve café — 日本語のテキスト 🙂🚀 multi-byte characters.",
    "def forward(self, x): return x + residual",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences (every byte is representable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def llama_config(**overrides: Any) -> LlamaConfig:
    base = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    base.update(overrides)
    return LlamaConfig(**base)


def save_checkpoint(
    out_dir: Path,
    config: Any,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: Path | None = None,
    max_shard_size: str | None = None,
) -> torch.nn.Module:
    """A random HF model with `config`, saved to `out_dir`; returns the HF model (fp32)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Larger than the default init so that logits differ clearly between tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(str(out_dir), **kwargs)
    model.to(torch.float32)
    if tokenizer_dir is not None:
        PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out_dir))
    return model


def load_ours(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    compilation_config=None,
    quant_config=None,
    hf_config=None,
):
    """Our model loaded from `model_dir` (a folder, or a GGUF file with its `hf_config`),
    with the dense backend bound; eager unless a compilation config is given."""
    engine_config = EngineConfig.for_hf_config(
        hf_config or load_hf_config(model_dir),
        model=str(model_dir),
        dtype=dtype,
        compilation_config=compilation_config or CompilationConfig(mode="none"),
        quant_config=quant_config,
    )
    model = load_model(engine_config)
    for layer in engine_config.compilation_config.static_forward_context.values():
        layer.bind(DenseAttentionBackend())
    return model, engine_config


@torch.inference_mode()
def packed_logits(model, engine_config, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Logits for every position of several prompts run as one packed batch."""
    lens = [len(p) for p in prompts]
    positions = torch.cat([torch.arange(n) for n in lens])
    with set_forward_context(AttentionMetadata.dense(lens), engine_config):
        hidden = model(torch.cat(prompts), positions)
    return model.compute_logits(hidden).float()


@torch.inference_mode()
def hf_logits(hf_model, prompts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([hf_model(p[None]).logits[0] for p in prompts]).float()


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation, ignoring EOS (compare with `ignore_eos=True`)."""
    ids = torch.tensor([prompt])
    hf_model.generation_config.eos_token_id = None
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_greedy_checked(hf, prompt: list[int], n: int, margin: float) -> tuple[list[int], int]:
    """HF's greedy tokens and how many of them come before the first near tie."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    top2 = [s[0].float().topk(2).values for s in out.scores]
    checked = next((i for i, v in enumerate(top2) if v[0] - v[1] < margin), n)
    return out.sequences[0, len(prompt) :].tolist(), checked


def native_cpu_kernels() -> bool:
    """Whether our CPU kernels build here (AVX-512). Without them the compiler alone runs
    every product (passes/config.py `resolved`): a decode step's piece is one Inductor
    kernel, and a batch above 1 reaches Inductor's extern GEMM, which no CPU graph can
    record (that step runs piece by piece)."""
    from passes.ops import layer_kernels

    return layer_kernels.available()


def native_quantized_products() -> bool:
    """Whether our quantized products run here (AVX-512, or AVX2 + FMA: `quant_kernels.cpp`'s
    row products), so that a GGUF model's batched decode steps are native calls a CPU graph
    records, with or without the rest of our kernels."""
    from passes.manager import native_passes_built

    return "quantized_linear" in native_passes_built()


def completions(llm, prompts, params) -> list[tuple]:
    """Each request's (token ids, finish reason, text): what two engines must agree on."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


def all_blocks_free(llm) -> bool:
    """No KV block is held (every request finished and freed its own)."""
    bm = llm.llm_engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks
