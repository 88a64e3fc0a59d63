"""The one engine config object every model constructor receives.

It lives in `compilecore` (the lowest layer that needs it) so that `models/` can import it
without importing `runtime/`. Each part validates itself at construction and names the
field that is wrong.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from passes.config import PassConfig
from passes.native import cache_root  # noqa: F401 - compilecore's public name

logger = logging.getLogger("compilecore")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: Any) -> torch.dtype:
    """`auto` means the checkpoint's dtype (fp32 when the checkpoint does not say)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if isinstance(checkpoint_dtype, torch.dtype):
            return checkpoint_dtype
        if isinstance(checkpoint_dtype, str) and checkpoint_dtype in _DTYPES:
            return _DTYPES[checkpoint_dtype]
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    model: str
    hf_config: Any
    dtype: torch.dtype = torch.float32
    max_model_len: int = 2048
    seed: int = 0
    # transformers' GenerationConfig from generation_config.json, when the folder has one
    # (the engine takes its extra EOS ids; the LLM its sampling defaults).
    generation_config: Any = None
    # models.layers.quantization.QuantizationConfig: which layers hold quantized weights
    # (a GGUF file's, or a float checkpoint's quantized when loaded); None: none.
    quant_config: Any = None

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else "LlamaForCausalLM"

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@dataclass
class CacheConfig:
    block_size: int = 16
    # Bytes for the KV cache on CPU; on CUDA, None means `gpu_memory_utilization`.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # "auto" (Triton on CUDA, the C++ kernels on CPU), "torch", "cpu" or "triton";
    # the COMPILECORE_ATTENTION_BACKEND environment variable overrides it.
    attention_backend: str = "auto"
    # The Triton backend's split-KV decode: None chooses per step; a number forces it
    # (the device check runs the split and merge kernels with 4).
    attention_num_splits: int | None = None
    num_gpu_blocks: int | None = None  # set by the engine once the budget is known

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(
                "attention_backend must be auto, torch, cpu or triton, got "
                f"{self.attention_backend!r}"
            )
        if self.attention_num_splits is not None and self.attention_num_splits < 1:
            raise ValueError(
                f"attention_num_splits must be at least 1, got {self.attention_num_splits}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # vLLM's: launch each step before the last one's tokens reach the host, while every
    # request samples greedily (runtime/async_scheduling.py); one process only.
    async_scheduling: bool = False
    # Batch-invariant mode: a prompt is prefilled in chunks of exactly this many tokens
    # (its last shorter), whatever else runs; a chunk that does not fit waits a step.
    invariant_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config`: method "ngram" (prompt lookup: up to
    `num_speculative_tokens` proposed per step from the request's own tokens, where its
    last `prompt_lookup_max` .. `prompt_lookup_min` tokens occurred before) or, given a
    `model` (a smaller model with the same tokenizer: a folder or a GGUF file), method
    "draft_model": that model's greedy tokens (runtime/spec_decode.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    # Ours: a request whose verifications emit fewer tokens than this on average stops
    # proposing for a while. A fixed number, not the measured cost of a verification, so
    # that a request's tokens do not depend on timing. None: 1 + k / 2 on CPU (with the
    # decode graphs a verification of 1 + k tokens cost 2.4 one-token steps at k = 3, 3.3
    # at k = 5 on the default model: benchmarks/bench_spec.py), 1.2 else.
    min_tokens_per_verification: float | None = None

    @classmethod
    def from_any(cls, value: Any) -> SpeculativeConfig | None:
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(
                f"speculative_config: unknown keys {unknown}; known: "
                f"{[f.name for f in fields(cls)]}"
            )
        if value.get("model") is not None and "method" not in value:  # vLLM infers it
            value = {**value, "method": "draft_model"}
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config method={self.method!r} is not supported; use 'ngram' "
                "or a draft model ({'model': PATH, ...})"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config: method 'draft_model' takes a 'model' (a smaller model "
                f"with the same tokenizer), method 'ngram' none; got method={self.method!r}, "
                f"model={self.model!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config {name} must be an integer >= 1, got {value!r}"
                )
        floor = self.min_tokens_per_verification
        if floor is not None and not (isinstance(floor, int | float) and floor >= 1):
            raise ValueError(
                f"speculative_config min_tokens_per_verification must be >= 1, got {floor!r}"
            )
        if not isinstance(self.prompt_lookup_max, int) or (
            self.prompt_lookup_max < self.prompt_lookup_min
        ):
            raise ValueError(
                f"speculative_config prompt_lookup_max={self.prompt_lookup_max!r} must be an "
                f"integer >= prompt_lookup_min={self.prompt_lookup_min}"
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# Batch-1 decode gets static-size code (where the GEMV pass turns each linear layer into one
# weight-streaming loop) and a CPU graph. Sizes 2 and 4 were measured and left out: Inductor's
# reduction loops for them re-read the weights per row (docs/kernel-choices.md, Static-size
# code).
DEFAULT_CPU_COMPILE_SIZES = (1,)


def resolve_custom_passes(specs: Any) -> list[Any]:
    """Each spec as a passes.GraphPass, with names that tell passes apart in match counts,
    dumps and verifier messages."""
    from passes.base import as_pass
    from passes.config import DEVICE_DEFAULTS

    if isinstance(specs, str) or not isinstance(specs, list | tuple):
        raise TypeError(f"compilation_config.custom_passes must be a list, got {specs!r}")
    resolved = [as_pass(spec) for spec in specs]
    taken = {"noop_elimination", "cleanup", *DEVICE_DEFAULTS["cpu"]}
    for p in resolved:
        if p.name == "graph_pass":
            raise ValueError(f"custom pass {p!r} has no name: set its `name` attribute")
        if p.name in taken:
            raise ValueError(
                f"custom pass name {p.name!r} is already taken (built-in passes and other "
                "custom passes); give the pass another `name`"
            )
        taken.add(p.name)
    return resolved


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass
class CompilationConfig:
    # "none": plain eager module; "piecewise": traced once, cut at attention, compiled.
    mode: str = "piecewise"
    splitting_ops: list[str] = field(
        default_factory=lambda: ["compilecore::unified_attention_with_output"]
    )
    # Token counts that get code of their own besides the symbolic-size code. None: the
    # device's default ([1] on CPU: batch-1 decode, where static shapes let the GEMV pass
    # run and a CPU graph replays it; [] on CUDA, where CUDA graphs cover small batches).
    # On CPU, decode-only batches pad up to the next compile size and replay its graph.
    compile_sizes: list[int] | None = None
    cudagraph_capture_sizes: list[int] | None = None
    # vLLM's CUDAGraphMode by name (compilecore/cuda_graph.py): "PIECEWISE",
    # "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE" or "NONE". Full graphs need one process and
    # an attention backend with fixed launches (Triton); elsewhere they fall back to pieces.
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    # CPU only: record each decode-only step at a graph size once and replay its native
    # calls with no Python between kernels (compilecore/cpu_graph.py).
    cpu_graphs: bool = True
    # Decode batch sizes recorded as CPU graphs (a batch pads up to the next one). None:
    # the compile sizes plus 2..16, whose symbolic-size code is native calls too (the
    # `packed_linear` products); a size whose step computes outside native calls is
    # refused at capture and runs piece by piece.
    cpu_graph_sizes: list[int] | None = None
    cache_dir: str | None = None
    debug_dump_path: str | None = None
    # Keep Dynamo's guards and raise on any recompile (slower; for tests and debugging).
    debug: bool = False
    # Inductor config patches for every piece, e.g. {"freezing": True}.
    inductor_options: dict[str, Any] = field(default_factory=dict)
    # Pass switches: a passes.config.PassConfig or a dict of its fields.
    passes: Any = None
    # False: Inductor's generated code only on CPU (no pass emits our C kernels' ops and
    # the LM head is a compiled loop), the compiler's own number beside the native one.
    native_kernels: bool = True
    # Each request's tokens and logprobs bit-identical whatever else is in its batch (vLLM's
    # `VLLM_BATCH_INVARIANT=1`, which sets it when None): products and attention whose rows
    # never depend on the others, prompts chunked by their own length only, steps of one
    # kind of query, no prefix-cache hits, no static-size code (docs/decoding.md).
    batch_invariant: bool | None = None
    # User passes, run after the built-in fusions: passes.GraphPass / PatternPass
    # instances or subclasses, functions graph -> int, or "module:attribute" paths.
    custom_passes: list[Any] = field(default_factory=list)
    # Layers that run outside the compiled graph, by prefix (attention layers).
    static_forward_context: dict[str, Any] = field(default_factory=dict, repr=False)
    # This engine's CUDA-graph memory pool (compilecore/cuda_graph.py `graph_pool`): its
    # pieces and whole steps share it; another engine in the process has its own.
    graph_pool: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.passes = PassConfig.from_any(self.passes)
        if not self.native_kernels:
            self.passes.native_kernels = False
        if self.batch_invariant is None:
            self.batch_invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")
        if self.batch_invariant:
            self.passes.batch_invariant = True
        self.custom_passes = resolve_custom_passes(self.custom_passes)
        if self.cpu_graphs and self._cpp_wrapper():
            # Its kernels are called from C inside the wrapper, out of the capture's sight: a
            # graph would replay the native ops without the code between them.
            logger.info("cpp_wrapper: Inductor calls its kernels from C, which a CPU graph "
                        "cannot record; CPU graphs are off")  # fmt: skip
            self.cpu_graphs = False
        if self.mode not in ("none", "piecewise"):
            raise ValueError(
                f"compilation_config.mode must be 'none' or 'piecewise', got {self.mode!r}"
            )
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"compilation_config.cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}"
                f", got {self.cudagraph_mode!r}"
            )
        for name in ("compile_sizes", "cpu_graph_sizes"):
            for size in getattr(self, name) or []:
                if size < 1:
                    raise ValueError(f"compilation_config.{name} must be >= 1, got {size}")

    def _cpp_wrapper(self) -> bool:
        if "cpp_wrapper" in self.inductor_options:
            return bool(self.inductor_options["cpp_wrapper"])
        import torch._inductor.config as inductor_config

        return bool(inductor_config.cpp_wrapper)

    @classmethod
    def from_any(cls, value: CompilationConfig | dict | None) -> CompilationConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"compilation_config has unknown fields: {sorted(unknown)}")
            return cls(**value)
        raise TypeError(
            f"compilation_config must be a CompilationConfig or dict, got {type(value)}"
        )


@dataclass
class EngineConfig:
    """vLLM's `VllmConfig`: everything a model (and the engine) needs to know."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        cc = self.compilation_config
        if cc.batch_invariant:
            self._batch_invariant()
        if self.speculative_config is not None:
            self._speculative()
        if cc.compile_sizes is None:
            cc.compile_sizes = list(DEFAULT_CPU_COMPILE_SIZES) if self.device.type == "cpu" else []
        sched, model = self.scheduler_config, self.model_config
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < model.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={sched.max_num_batched_tokens} is smaller than "
                f"max_model_len={model.max_model_len}; enable chunked prefill or raise it"
            )

    def _batch_invariant(self) -> None:
        """What batch-invariant mode needs of the other parts; a part set against it is an
        error naming it (tests/test_batch_invariant.py)."""
        from passes.ops.quantized import INVARIANT_ROWS

        cc, cache, sched = self.compilation_config, self.cache_config, self.scheduler_config
        # A decode step padded past INVARIANT_ROWS rows would take the long steps' products.
        padded = [s for s in cc.cpu_graph_sizes or [] if s > INVARIANT_ROWS]
        wrong = [
            (cc.mode != "piecewise", f"mode={cc.mode!r}", "needs mode='piecewise' (a pass)"),
            (bool(cc.compile_sizes), f"compile_sizes={cc.compile_sizes}",
             "keeps one code for every size"),
            (bool(padded), f"cpu_graph_sizes {padded}",
             f"keeps decode steps at most {INVARIANT_ROWS} rows"),
        ]  # fmt: skip
        for bad, setting, why in wrong:
            if bad:
                raise ValueError(f"batch_invariant {why}: {setting} cannot be used with it")
        cc.compile_sizes = []
        # A hit skips rows a run without it computes in another chunk: none are taken.
        cache.enable_prefix_caching = False
        # Long chunks run in steps of their own (runtime/scheduler.py): a whole budget each.
        sched.invariant_chunk = sched.max_num_batched_tokens

    def _speculative(self) -> None:
        spec, sched = self.speculative_config, self.scheduler_config
        if spec.min_tokens_per_verification is None:
            cpu = self.device.type == "cpu"
            spec.min_tokens_per_verification = 1 + spec.num_speculative_tokens / 2 if cpu else 1.2
        if sched.async_scheduling:
            raise ValueError(
                "speculative_config cannot be used with async_scheduling yet (a step's "
                "proposals need its last tokens on the host): drop one of them"
            )

    @classmethod
    def for_hf_config(cls, hf_config: Any, **parts: Any) -> EngineConfig:
        """A config around an in-memory HF config (tests, tools)."""
        model_config = ModelConfig(
            model=parts.pop("model", ""),
            hf_config=hf_config,
            dtype=parts.pop("dtype", torch.float32),
            max_model_len=parts.pop(
                "max_model_len", getattr(hf_config, "max_position_embeddings", 2048)
            ),
            quant_config=parts.pop("quant_config", None),
        )
        return cls(model_config=model_config, **parts)
