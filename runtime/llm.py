"""`LLM`: vLLM's offline API. `from runtime import LLM, SamplingParams`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from compilecore.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from compilecore.cuda_graph import default_capture_sizes
from models.default_model import ensure_default_model
from models.loader import ModelLoadError, checkpoint_dtype, load_hf_config
from models.registry import resolve_model_class
from runtime.engine import LLMEngine
from runtime.executor import MultiprocExecutor, validate_parallel_config
from runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runtime.request import Request
from runtime.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        distributed_executor_backend: str = "mp",
        **engine_args: Any,
    ):
        """`engine_args`: see `build_engine_config` (dtype, max_model_len, max_num_seqs,
        max_num_batched_tokens, block_size, kv_cache_memory, enable_prefix_caching,
        attention_backend, enforce_eager, compilation_config, tensor_parallel_size,
        pipeline_parallel_size, seed, device). `distributed_executor_backend="external"`
        joins ranks that torchrun started (see runtime/launch.py)."""
        self.engine_config = build_engine_config(model, **engine_args)
        model_dir = self.engine_config.model_config.model
        self.tokenizer = _load_tokenizer(tokenizer or model_dir)
        executor = None
        if self.engine_config.parallel_config.world_size > 1:
            validate_parallel_config(self.engine_config)
            external = distributed_executor_backend == "external"
            executor = MultiprocExecutor(self.engine_config, external=external)
        try:
            self.llm_engine = LLMEngine(self.engine_config, self.tokenizer, executor)
        except BaseException:
            if executor is not None:
                executor.shutdown(force=True)
            raise
        self._finalizer = weakref.finalize(self, self.llm_engine.executor.shutdown)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the other ranks (if any). Also runs when the LLM is garbage collected."""
        self._finalizer()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        # Everything is checked before any request is added: a bad prompt costs nothing.
        token_lists = [self._tokenize(i, p) for i, p in enumerate(prompt_list)]
        ids = []
        for tokens, sp in zip(token_lists, params):
            request_id = str(next(self._counter))
            ids.append(request_id)
            for index in range(sp.n):
                child = sp if sp.n == 1 else sp.for_sample(index)
                self.llm_engine.add_request(Request(f"{request_id}-{index}", tokens, child))
        finished = self._run(sum(p.n for p in params), use_tqdm)
        return [
            self._make_output(rid, _prompt_text(prompt), tokens, sp.n, finished)
            for rid, prompt, tokens, sp in zip(ids, prompt_list, token_lists, params)
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, conversation: list[dict], add_generation_prompt: bool = True
    ) -> dict:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use generate()")
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    # -- internals ------------------------------------------------------------------------
    def _tokenize(self, index: int, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                tokens = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                tokens = self.tokenizer.encode(prompt["prompt"]) if prompt["prompt"] else []
            else:
                raise ValueError(
                    f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'"
                )
        else:
            tokens = list(prompt)
        if not tokens:
            raise ValueError(f"prompt {index} is empty")
        if not all(isinstance(t, int) for t in tokens):
            raise TypeError(f"prompt {index}: token ids must be integers")
        vocab = self.engine_config.model_config.hf_config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompt {index}: token id {bad} is outside the vocabulary [0, {vocab})"
            )
        max_len = self.engine_config.model_config.max_model_len
        if len(tokens) >= max_len:
            raise ValueError(
                f"prompt {index} has {len(tokens)} tokens, but max_model_len={max_len} leaves no "
                "room to generate: shorten the prompt or raise max_model_len"
            )
        return tokens

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, Request]:
        engine, finished = self.llm_engine, {}
        bar = tqdm(
            total=num_requests, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for req in engine.step():
                    finished[req.request_id] = req
                    generated += len(req.output_token_ids)
                    bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"{generated / elapsed:.1f} tok/s", refresh=False)
        finally:
            bar.close()
        return finished

    def _make_output(
        self, rid: str, prompt: str | None, tokens: list[int], n: int, finished: dict[str, Request]
    ) -> RequestOutput:
        children = [finished[f"{rid}-{i}"] for i in range(n)]
        outputs = []
        for i, req in enumerate(children):
            logprobs = req.output_logprobs or None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=self.llm_engine.output_text(req.request_id),
                    token_ids=list(req.output_token_ids),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=logprobs,
                    cumulative_logprob=(
                        sum(lp[t] for lp, t in zip(logprobs, req.output_token_ids))
                        if logprobs
                        else None
                    ),
                )
            )
            self.llm_engine.release(req.request_id)
        first = children[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_token_time=min(
                (c.first_token_time for c in children if c.first_token_time), default=None
            ),
            finished_time=max((c.finished_time for c in children if c.finished_time), default=None),
            num_generated_tokens=sum(len(c.output_token_ids) for c in children),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(rid, prompt, tokens, outputs, True, metrics)


def build_engine_config(
    model: str | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    enable_prefix_caching: bool = True,
    attention_backend: str = "auto",
    enforce_eager: bool = False,
    compilation_config: CompilationConfig | dict | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 0,
    device: str | None = None,
) -> EngineConfig:
    """The engine config for a model folder (None: the embedded default model)."""
    model_dir = Path(model) if model is not None else ensure_default_model()
    hf_config = load_hf_config(model_dir)
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    try:
        resolve_model_class(archs[0])
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    compilation = CompilationConfig.from_any(compilation_config)
    if enforce_eager:
        compilation.mode = "none"
    device_obj = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if compilation.cudagraph_capture_sizes is None and device_obj.type == "cuda":
        compilation.cudagraph_capture_sizes = default_capture_sizes(max_num_batched_tokens)
    return EngineConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, checkpoint_dtype(hf_config)),
            max_model_len=max_model_len or hf_config.max_position_embeddings,
            seed=seed,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
        ),
        scheduler_config=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
        parallel_config=ParallelConfig(tensor_parallel_size, pipeline_parallel_size),
        compilation_config=compilation,
        device=device_obj,
    )


def _prompt_text(prompt: PromptType) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    if not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a string, a list of strings or a list of token-id lists, "
            f"got {type(prompts).__name__}"
        )
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, dict, list, tuple)):
            raise TypeError(
                f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}"
            )
    return list(prompts)


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be SamplingParams or a list of them")
    return params


def _load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e
