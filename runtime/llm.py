"""`LLM`: vLLM's offline API. `from runtime import LLM, SamplingParams`."""

from __future__ import annotations

import difflib
import gc
import inspect
import itertools
import os
import traceback
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from compilecore.compile_cache import cache_disabled, check_cache_root
from compilecore.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    cache_root,
    resolve_dtype,
)
from compilecore.cuda_graph import default_capture_sizes
from models import gguf
from models.default_model import ensure_default_model, find_gguf
from models.layers.quantization import QuantizationConfig, quantization_config
from models.loader import ModelLoadError, checkpoint_dtype, load_hf_config
from models.registry import resolve_model_class
from runtime.engine import LLMEngine
from runtime.executor import MultiprocExecutor, validate_parallel_config
from runtime.outputs import SPEC_COUNTS, CompletionOutput, RequestMetrics, RequestOutput
from runtime.request import Request
from runtime.sampling_params import SamplingParams

PromptType = str | list[int] | dict


EXECUTOR_BACKENDS = {None: "mp", "mp": "mp", "uni": "uni", "external": "external",
                     "external_launcher": "external"}  # fmt: skip
# generation_config.json fields that become sampling defaults (vLLM's list and names).
GENERATION_DEFAULTS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
# What `apply_chat_template` passes to the tokenizer's itself (render() takes `messages`).
_CHAT_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "chat_template",
                       "add_generation_prompt", "continue_final_message", "tools"}  # fmt: skip


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        tokenizer_mode: str = "auto",
        skip_tokenizer_init: bool = False,
        distributed_executor_backend: str | None = None,
        max_logprobs: int = 20,
        **engine_args: Any,
    ):
        """`engine_args`: see `build_engine_config` (vLLM's names: dtype, max_model_len,
        max_num_seqs, max_num_batched_tokens, block_size, gpu_memory_utilization,
        enable_prefix_caching, enable_chunked_prefill, enforce_eager, compilation_config,
        tensor_parallel_size, pipeline_parallel_size, seed, trust_remote_code,
        async_scheduling, speculative_config; ours:
        kv_cache_memory, attention_backend, attention_num_splits, device).
        `distributed_executor_backend="external"` joins ranks that torchrun started (see
        runtime/launch.py). `max_logprobs` caps `logprobs` and `prompt_logprobs` (vLLM's
        default, 20)."""
        if distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend={distributed_executor_backend!r} is not supported"
                f"; use one of {sorted(k for k in EXECUTOR_BACKENDS if k)} (or None)"
            )
        if not isinstance(max_logprobs, int) or max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be an integer >= 0 or -1 (no cap), got {max_logprobs!r}"
            )
        self.max_logprobs = max_logprobs
        _check_engine_arg_names(engine_args)
        self.engine_config = build_engine_config(model, **engine_args)
        model_dir = self.engine_config.model_config.model
        backend = EXECUTOR_BACKENDS[distributed_executor_backend]
        world_size = self.engine_config.parallel_config.world_size
        if backend == "uni" and world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process, but tensor x pipeline "
                f"parallel size is {world_size}: use 'mp'"
            )
        if tokenizer_mode != "auto":
            raise ValueError(
                f"tokenizer_mode={tokenizer_mode!r} is not supported: use 'auto' (the folder's "
                "fast tokenizer)"
            )
        trust = bool(engine_args.get("trust_remote_code", False))
        self.tokenizer = (
            None if skip_tokenizer_init else _load_tokenizer(tokenizer or model_dir, trust)
        )
        executor = None
        if world_size > 1:
            validate_parallel_config(self.engine_config)
            executor = MultiprocExecutor(self.engine_config, external=backend == "external")
        try:
            draft = _draft_engine(self.engine_config, engine_args)
            self.llm_engine = LLMEngine(self.engine_config, self.tokenizer, executor, draft)
        except BaseException as error:
            if executor is not None:
                executor.shutdown(force=True)
            _release_failed_start(error)
            raise
        self._finalizer = weakref.finalize(self, self.llm_engine.executor.shutdown)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the other ranks (if any). Also runs when the LLM is garbage collected."""
        self._finalizer()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults overridden by the model's generation_config.json (the fields it
        sets among temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)."""
        config = self.engine_config.model_config.generation_config
        if config is None:
            return SamplingParams()
        given = config.to_diff_dict() if hasattr(config, "to_diff_dict") else vars(config)
        kwargs = {ours: given[hf] for hf, ours in GENERATION_DEFAULTS.items() if hf in given}
        return SamplingParams(**kwargs)

    # -- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompt_list))
        # Everything is checked before any request is added: a bad prompt or parameter
        # costs nothing and leaves nothing behind.
        token_lists = [self._tokenize(i, *pair) for i, pair in enumerate(zip(prompt_list, params))]
        for i, sp in enumerate(params):
            self._validate_params(i, sp)
        ids, added = [], []
        try:
            for tokens, sp in zip(token_lists, params):
                request_id = str(next(self._counter))
                ids.append(request_id)
                bad_words = self._bad_words_token_ids(sp)
                for index in range(sp.n):
                    child = sp if sp.n == 1 else sp.for_sample(index)
                    req = Request(f"{request_id}-{index}", tokens, child)
                    req.bad_words_token_ids = bad_words
                    self.llm_engine.add_request(req)
                    added.append(req.request_id)
            finished = self._run(added, use_tqdm)
        except BaseException:
            # A failed step or Ctrl-C: this call's requests go, the LLM stays usable.
            self.llm_engine.abort_request(added)
            raise
        return [
            self._make_output(rid, _prompt_text(prompt), tokens, sp.n, finished)
            for rid, prompt, tokens, sp in zip(ids, prompt_list, token_lists, params)
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them (a batch), vLLM's options."""
        if not messages:
            raise ValueError("messages is empty: pass a conversation or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(
                c,
                add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )  # fmt: skip
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> dict:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this LLM was made with skip_tokenizer_init")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template: pass chat_template= or use generate()"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: the "
                "first continues the last message, the second starts a new one"
            )
        kwargs = dict(chat_template_kwargs or {})
        taken = sorted(set(kwargs) & _CHAT_TEMPLATE_ARGS)
        if taken:
            raise ValueError(
                f"chat_template_kwargs may not set {taken}: they are apply_chat_template's "
                "own arguments (pass the conversation and flags themselves)"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **kwargs,
            )
        except Exception as e:  # the template is the caller's code: it may raise anything
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ValueError(f"the chat template rendered {type(text).__name__}, not text")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    # -- internals ------------------------------------------------------------------------
    def _tokenize(
        self, index: int, prompt: PromptType, params: SamplingParams | None = None
    ) -> list[int]:
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt")
        if text is not None and self.tokenizer is None:
            raise ValueError(
                f"prompt {index} is text, but this LLM has no tokenizer (skip_tokenizer_init"
                "=True): pass token ids, e.g. {'prompt_token_ids': [...]}"
            )
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
        keep = None if params is None else params.truncate_prompt_tokens
        if keep is not None:
            if keep > max_len:
                raise ValueError(
                    f"prompt {index}: truncate_prompt_tokens={keep} is greater than "
                    f"max_model_len={max_len}: choose a smaller value, or -1 for the longest "
                    "prompt that fits"
                )
            # -1: the longest prompt that leaves room for one generated token.
            tokens = tokens[-(max_len - 1 if keep == -1 else keep) :]
        if len(tokens) >= max_len:
            raise ValueError(
                f"prompt {index} has {len(tokens)} tokens, but max_model_len={max_len} leaves no "
                "room to generate: shorten the prompt or raise max_model_len"
            )
        return tokens

    def _validate_params(self, index: int, sp: SamplingParams) -> None:
        where = f"sampling_params for prompt {index}"
        vocab = self.engine_config.model_config.hf_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = sp.top_logprobs(name, vocab)
            if value is not None and self.max_logprobs != -1 and value > self.max_logprobs:
                every = f" (every token: {value})" if getattr(sp, name) == -1 else ""
                raise ValueError(
                    f"{where}: {name}={getattr(sp, name)}{every} exceeds max_logprobs="
                    f"{self.max_logprobs} (raise LLM(max_logprobs=...), -1 for no cap)"
                )
        bad = next((t for t in sp.token_ids_used() if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})")
        if self.tokenizer is None and (sp.stop_strings or sp.bad_words):
            raise ValueError(
                f"{where}: stop strings and bad_words need a tokenizer (skip_tokenizer_init)"
            )
        self._check_some_token_allowed(where, sp)
        if sp.structured_outputs is not None:
            try:
                self.llm_engine.grammars().compile(sp.structured_outputs)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None

    def _check_some_token_allowed(self, where: str, sp: SamplingParams) -> None:
        """Refuses params whose constraints leave no token to generate first, where that
        is known before the request runs (the sampler would give it nothing to draw)."""
        if not sp.allowed_token_ids:
            return
        allowed = set(sp.allowed_token_ids)
        banned = {w[0] for w in self._bad_words_token_ids(sp) if len(w) == 1}
        if not allowed - banned:
            raise ValueError(
                f"{where}: bad_words ban every token of allowed_token_ids, so no token can be "
                "generated: allow more tokens or ban fewer words"
            )
        if sp.min_tokens:
            stops = set(sp.stop_token_ids or ())
            if not sp.ignore_eos:
                stops |= self.llm_engine.eos_token_ids
            if not allowed - banned - stops:
                raise ValueError(
                    f"{where}: min_tokens={sp.min_tokens} forbids the stop and EOS tokens "
                    f"{sorted(stops)}, and allowed_token_ids has no other token: allow more "
                    "tokens, or set min_tokens=0 (or ignore_eos=True)"
                )

    def _bad_words_token_ids(self, sp: SamplingParams) -> list[list[int]]:
        """Each bad word as tokens, alone and after a space (as vLLM bans them)."""
        words: list[list[int]] = []
        for word in sp.bad_words or []:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return words

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, Request]:
        engine, finished = self.llm_engine, {}
        bar = tqdm(
            total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
            dynamic_ncols=True,
        )  # fmt: skip
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
                    cumulative_logprob=(
                        sum(lp[t].logprob for lp, t in zip(logprobs, req.output_token_ids))
                        if logprobs
                        else None
                    ),
                    logprobs=logprobs,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
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
            **{name: sum(getattr(c.spec, name) for c in children) for name in SPEC_COUNTS},
        )
        return RequestOutput(
            rid, prompt, tokens, outputs, True, metrics,
            prompt_logprobs=first.prompt_logprobs or None,
            num_cached_tokens=first.num_cached_tokens,
        )  # fmt: skip


def cuda_index_pinned(device: torch.device) -> torch.device:
    """A CUDA device with its index: "cuda" is the current device now, and stays that one
    whatever the process's current device is later (the executor enters it for every
    call). An index past the devices present is refused by name."""
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: no CUDA device is available (use 'cpu')")
    count = torch.cuda.device_count()
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= count:
        raise ValueError(f"device={str(device)!r}: this machine has {count} CUDA device(s)")
    return device


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
    attention_num_splits: int | None = None,
    enforce_eager: bool = False,
    compilation_config: CompilationConfig | dict | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 0,
    device: str | None = None,
    gpu_memory_utilization: float = 0.9,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = False,
    speculative_config: dict | SpeculativeConfig | None = None,
    trust_remote_code: bool = False,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    load_format: str = "auto",
    swap_space: float = 4,
    disable_log_stats: bool = True,
) -> EngineConfig:
    """The engine config for a model folder (None: the embedded default model). The
    arguments are vLLM's EngineArgs of the same names; `swap_space` and
    `disable_log_stats` are accepted and change nothing (a preempted request is recomputed,
    as in vLLM V1, and the offline LLM logs no stats)."""
    _check_vllm_only_args(kv_cache_dtype, swap_space, disable_log_stats)
    model_dir = _model_path(model, load_format)
    hf_config = load_hf_config(config_dir(model_dir), trust_remote_code=trust_remote_code)
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    try:
        resolve_model_class(archs[0])
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    compilation = CompilationConfig.from_any(compilation_config)
    if enforce_eager:
        compilation.mode = "none"
    if compilation.mode != "none" and not cache_disabled():
        # Before anything loads code from it: a foreign or world-writable folder is refused.
        check_cache_root(Path(compilation.cache_dir or cache_root() / "torch_compile"))
    device_obj = cuda_index_pinned(
        torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    )
    quant_config = _quant_config(model_dir, quantization, device_obj.type)
    if compilation.cudagraph_capture_sizes is None and device_obj.type == "cuda":
        compilation.cudagraph_capture_sizes = default_capture_sizes(max_num_batched_tokens)
    if async_scheduling and tensor_parallel_size * pipeline_parallel_size > 1:
        raise ValueError(
            "async_scheduling runs one process: the ranks' steps are not pipelined yet (drop "
            "it, or tensor_parallel_size / pipeline_parallel_size)"
        )
    too_big = [s for s in compilation.cudagraph_capture_sizes or [] if s > max_num_batched_tokens]
    if too_big:
        raise ValueError(
            f"cudagraph_capture_sizes {too_big} exceed max_num_batched_tokens="
            f"{max_num_batched_tokens}: no step has that many tokens; drop them or raise "
            "max_num_batched_tokens"
        )
    return EngineConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, checkpoint_dtype(hf_config)),
            max_model_len=(
                hf_config.max_position_embeddings if max_model_len is None else max_model_len
            ),
            generation_config=_load_generation_config(config_dir(model_dir)),
            seed=seed,
            quant_config=quant_config,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            attention_num_splits=attention_num_splits,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, async_scheduling
        ),
        parallel_config=ParallelConfig(tensor_parallel_size, pipeline_parallel_size),
        compilation_config=compilation,
        device=device_obj,
        speculative_config=SpeculativeConfig.from_any(speculative_config),
    )


def _draft_engine(config: EngineConfig, engine_args: dict[str, Any]) -> LLMEngine | None:
    """The draft model's engine for speculative_config's "draft_model" method (None for
    any other): the target's device, lengths, batch and cache settings, no prefix caching
    (its sequences are rewound over rejected drafts: runtime/spec_decode.py); the same
    vocabulary, or an error naming both."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return None
    if config.parallel_config.world_size > 1:
        raise ValueError("speculative_config: a draft model runs in one process; drop it, "
                         "or tensor_parallel_size / pipeline_parallel_size")  # fmt: skip
    keep = ("dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
            "enforce_eager", "seed", "trust_remote_code")  # fmt: skip
    args = {k: v for k, v in engine_args.items() if k in keep}
    cc = config.compilation_config
    draft_config = build_engine_config(
        spec.model, **args, max_model_len=config.model_config.max_model_len,
        device=str(config.device), enable_prefix_caching=False,
        compilation_config={"cache_dir": cc.cache_dir} if cc.cache_dir else None,
    )  # fmt: skip
    ours = config.model_config.hf_config.vocab_size
    theirs = draft_config.model_config.hf_config.vocab_size
    if ours != theirs:
        raise ValueError(
            f"speculative_config: the draft model {spec.model} has a vocabulary of {theirs} "
            f"tokens, the model {ours}: a draft model must share the model's tokenizer"
        )
    return LLMEngine(draft_config, None)


# vLLM's engine arguments that have no counterpart here: named as such (not a TypeError,
# and never ignored in silence).
# fmt: off
_VLLM_ENGINE_ARGS = frozenset({
    "revision", "code_revision", "tokenizer_revision", "download_dir",
    "config_format", "hf_config_path", "hf_overrides", "max_seq_len_to_capture",
    "disable_custom_all_reduce", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
    "lora_dtype", "fully_sharded_loras", "num_scheduler_steps",
    "cpu_offload_gb", "enable_expert_parallel", "data_parallel_size", "limit_mm_per_prompt",
    "mm_processor_kwargs", "disable_async_output_proc", "override_generation_config",
    "enable_sleep_mode", "calculate_kv_scales", "task", "runner", "num_gpu_blocks_override",
    "worker_cls", "enable_log_requests", "guided_decoding_backend",
    "structured_outputs_config", "reasoning_parser", "logits_processors", "pooler_config",
    "max_num_partial_prefills", "long_prefill_token_threshold", "scheduling_policy",
    "preemption_mode", "rope_scaling", "rope_theta", "disable_sliding_window",
    "served_model_name",
})
# fmt: on


def _release_failed_start(error: BaseException) -> None:
    """Lets go of what a failed start built (weights, KV cache, compiled code): the frames
    that the error's traceback keeps, and its causes', lose their locals (the traceback's
    lines stay; running frames are left whole), so that a caller keeping the error (a
    notebook's last traceback, a retry loop) does not keep the engine; the device's cache
    goes back for the retry."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        exc = pending.pop()
        if exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)
            pending += [exc.__cause__, exc.__context__]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_engine_arg_names(engine_args: dict[str, Any]) -> None:
    """A vLLM engine argument this engine lacks is a ValueError naming it; a name that is
    nobody's is a TypeError with the closest known names."""
    known = set(inspect.signature(build_engine_config).parameters) - {"model"}
    for name in engine_args:
        if name in known:
            continue
        if name in _VLLM_ENGINE_ARGS:
            raise ValueError(
                f"vLLM's engine argument {name!r} has no counterpart in compilecore: drop it "
                "(docs/vllm-compatibility.md)"
            )
        close = difflib.get_close_matches(name, sorted(known | _VLLM_ENGINE_ARGS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TypeError(f"LLM() got an unexpected engine argument {name!r}{hint}")


LOAD_FORMATS = ("auto", "gguf", "safetensors")


def _model_path(model: str | None, load_format: str) -> Path:
    """The model's folder or GGUF file. The default model is its shipped GGUF file, run
    from its blocks; `load_format="safetensors"` takes its dequantized copy (bf16)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported: use one of {LOAD_FORMATS}")
    if model is None:
        if load_format == "safetensors":
            return ensure_default_model()
        return find_gguf()
    path = resolve_model_dir(model)
    if load_format == "gguf" and not gguf.is_gguf(path):
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {path}")
    if load_format == "safetensors" and gguf.is_gguf(path):
        raise ValueError(f"load_format='safetensors' needs a model folder, got {path}")
    return path


def config_dir(model: Path) -> Path:
    """Where a model's config.json and tokenizer are: its folder, or for a GGUF file the
    folder they were extracted to once (models/gguf.py)."""
    return gguf.metadata_dir(model) if gguf.is_gguf(model) else model


def _quant_config(model: Path, quantization: str | None, device_type: str
                  ) -> QuantizationConfig | None:  # fmt: skip
    if gguf.is_gguf(model):
        if quantization not in (None, "gguf"):
            raise ValueError(
                f"quantization={quantization!r} does not apply to {model.name}: a GGUF file is "
                "quantized already (its blocks are kept); leave quantization=None or 'gguf'"
            )
        return gguf.quant_config(model, device_type)
    if quantization == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf file as the model, got {model}")
    return quantization_config(quantization)


def _check_vllm_only_args(kv_cache_dtype: str, swap_space: float, disable_log_stats: bool) -> None:
    """vLLM's arguments for what this engine does not have: their defaults pass, any
    other value says what is supported instead of being ignored."""
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported: the KV cache is kept in the "
            "model's dtype; use 'auto'"
        )
    if isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or swap_space < 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {swap_space!r}")
    if not isinstance(disable_log_stats, bool):
        raise ValueError(f"disable_log_stats must be True or False, got {disable_log_stats!r}")


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


def _load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    path = config_dir(Path(path))
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def _load_generation_config(path: Path) -> Any:
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path / 'generation_config.json'}: {e}") from e


def resolve_model_dir(model: str | Path) -> Path:
    """A model folder, or a Hugging Face id ("org/name") found in the local Hugging Face
    cache (offline: this engine downloads nothing); ModelLoadError says where it looked."""
    path = Path(model)
    name = str(model)
    if path.exists() or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return path
    from huggingface_hub import constants, snapshot_download

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # read now, not at import
    try:
        return Path(snapshot_download(name, local_files_only=True, cache_dir=cache))
    except Exception as e:  # not cached (or not a repo id at all)
        raise ModelLoadError(
            f"{name!r} is neither a folder nor a model in the local Hugging Face cache "
            f"({cache}; set HF_HUB_CACHE to look elsewhere): download it "
            f"first (huggingface-cli download {name}) or pass its folder ({type(e).__name__})"
        ) from None
