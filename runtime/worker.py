"""One rank's share of the work: its model shard, KV cache and runner."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compilecore.compile_cache import compile_cache_root
from compilecore.config import EngineConfig
from models.loader import load_model
from runtime.async_scheduling import Feed
from runtime.attention import TorchPagedAttentionBackend
from runtime.attention.cpu_build import KernelBuildError, load_cpu_kernels
from runtime.attention.cpu_paged import CpuPagedAttentionBackend
from runtime.attention.triton_paged import (
    TritonPagedAttentionBackend,
    interpreter_problem,
    triton_usable,
)
from runtime.huge_pages import pack_parameters
from runtime.lm_head import reads_blocks
from runtime.model_runner import ModelRunner, StepPlan

logger = logging.getLogger("compilecore")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
BACKENDS = ("auto", "torch", "cpu", "triton")


def select_attention_backend(
    device: torch.device,
    requested: str = "auto",
    cache_dir: Path | None = None,
    num_splits: int | None = None,
    batch_invariant: bool = False,
) -> Any:
    """Triton on CUDA, the C++ kernels on CPU (torch if they cannot be built), unless the
    config or the environment forces one. `num_splits` forces the Triton backend's
    split-KV decode and is refused by the others, which have none. `batch_invariant`:
    the same backends with splits that never follow the batch, and short queries' rows
    attended as decodes (the torch backend computes one sequence at a time)."""
    choice = os.environ.get("COMPILECORE_ATTENTION_BACKEND", requested)
    if choice not in BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}; use one of {', '.join(BACKENDS)}")
    if choice == "auto":
        if device.type == "cuda" and triton_usable(device):
            choice = "triton"
        elif device.type == "cpu" and cpu_kernels_usable(cache_dir):
            choice = "cpu"
        else:
            choice = "torch"
    if choice == "triton" and not triton_usable(device):
        broken = device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"
        why = interpreter_problem() if broken else None
        raise ValueError(
            (why + ": " if why else "the Triton attention backend needs a CUDA device (or "
             "TRITON_INTERPRET=1 to run its kernels in the interpreter); ")
            + "use attention_backend='torch'"
        )  # fmt: skip
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU tensors, not {device.type}")
    if num_splits is not None and choice != "triton":
        raise ValueError(
            f"attention_num_splits={num_splits} sets the Triton backend's split-KV decode; "
            f"this engine runs the {choice} attention backend, which has none (leave it unset, "
            "or use attention_backend='triton' on a CUDA device)"
        )
    logger.info("attention backend: %s on %s%s", choice, device.type,
                " (batch-invariant)" if batch_invariant else "")  # fmt: skip
    if choice == "cpu":
        return CpuPagedAttentionBackend(cache_dir=cache_dir, invariant=batch_invariant)
    if choice == "triton":
        if batch_invariant and num_splits not in (None, 1):
            raise ValueError(
                "batch_invariant keeps every decode in one split: "
                f"attention_num_splits={num_splits} cannot be used with it"
            )
        return TritonPagedAttentionBackend(num_splits=num_splits, invariant=batch_invariant)
    return TorchPagedAttentionBackend(per_sequence=batch_invariant)


def cpu_kernels_usable(cache_dir: Path | None = None) -> bool:
    try:
        load_cpu_kernels(cache_dir)
    except KernelBuildError as exc:
        logger.warning("CPU attention kernels unavailable, using the torch backend: %s", exc)
        return False
    return True


def kv_budget_after_profiling(
    total: int, gpu_memory_utilization: float, own_use: int, activation_peak: int, free: int
) -> int:
    """vLLM's rule: this engine may hold `gpu_memory_utilization` x `total` in all; what it
    already holds (weights, CUDA graphs, the allocator's blocks: `own_use`, measured after
    capture and empty_cache) and room for its largest step's activations (freed back to
    the driver, so not in `own_use`) come out of that, and the rest is the KV cache. Never
    more than is `free` now: another engine or process on the device keeps what it has."""
    budget = int(gpu_memory_utilization * total - own_use - activation_peak)
    return min(budget, int(free - activation_peak))


def check_invariant_products(model: nn.Module, engine_config: EngineConfig) -> None:
    """Batch-invariant mode refuses to start unless every product of `model` gives a row
    the same bits at every row count: each shape `invariant_mm` runs (its linear layers
    and LM head in the model's dtype, and in fp32 where quantized weights are dequantized
    for it; passes/ops/invariant_mm.py `check_rows`), and each quantized product that reads
    the blocks (`check_invariant_blocks`)."""
    from models.layers.linear import LinearBase
    from models.layers.quantization import formats_held
    from models.layers.vocab_embedding import ParallelLMHead
    from passes.ops.invariant_mm import LONG_ROWS, check_rows

    blocks = reads_blocks(engine_config)
    shapes, long_shapes, dequantized = set(), set(), False
    for module in model.modules():
        if not isinstance(module, LinearBase | ParallelLMHead):
            continue
        if isinstance(module, LinearBase):  # this rank's slice of it
            k = getattr(module, "input_size_per_partition", module.input_size)
            shape = (k, getattr(module, "output_size_per_partition", module.output_size))
        else:
            shape = (module.embedding_dim, module.num_embeddings_per_partition)
        held = formats_held(module)
        if held and blocks:  # q4's long steps: a dense copy's GEMM in tall tiles
            if isinstance(module, LinearBase) and any(f.has_mins for f, _ in held):
                long_shapes.add(shape)
            continue
        dequantized = dequantized or bool(held)
        shapes.add(shape)
    dtypes = {engine_config.model_config.dtype} | ({torch.float32} if dequantized else set())
    for k, n in sorted(shapes):
        for dtype in dtypes:
            check_rows(k, n, dtype, engine_config.device)
    if engine_config.model_config.dtype == torch.bfloat16:
        for k, n in sorted(long_shapes):
            check_rows(k, n, torch.bfloat16, engine_config.device, LONG_ROWS)
    if blocks:
        check_invariant_blocks(model, engine_config)


def check_invariant_blocks(model: nn.Module, engine_config: EngineConfig) -> None:
    """Where the quantized products read the blocks in batch-invariant mode (the
    `invariant` argument: the row products at every row count), each format and shape of
    `model`, on its own weights, must give the first m rows the bits they get among 48."""
    from models.layers.quantization import formats_held, quant_fields
    from passes.ops import quantized
    from passes.ops.invariant_mm import NotBatchInvariant

    seen = set()
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        for fmt, suffix in formats_held(module):
            fields = quant_fields(module, fmt, suffix)
            key = (fmt.bits, *((f.shape, f.dtype) for f in fields))
            if key in seen:
                continue
            seen.add(key)
            w = fields[0]
            columns = quantized.q4_columns if fmt.has_mins else quantized.q8_columns
            k = columns(w, fields[1])
            x = torch.randn(48, k, generator=g).to(engine_config.model_config.dtype)
            if rows := invariant_rows_that_differ(fmt, fields, x):
                raise NotBatchInvariant(
                    f"batch_invariant: rows {rows} of a q{fmt.bits} product of {key[1:]} "
                    "read from the blocks get other bits than in a 16-row call (up to 16) or "
                    "among 48 rows (more)"
                )


def invariant_rows_that_differ(fmt, fields, x: torch.Tensor) -> list[tuple[int, int]]:
    """(offset, rows) whose invariant product of x's rows gets other bits than their path
    gives them elsewhere: up to INVARIANT_ROWS rows the row products (against a call of
    that many rows), above it the strips (against all of x's 48 rows), at offsets 0 and 5."""
    from passes.ops.invariant_mm import CHECKED_ROWS
    from passes.ops.quantized import INVARIANT_ROWS

    short = fmt.product(x[:INVARIANT_ROWS], fields, invariant=True)
    full = fmt.product(x, fields, invariant=True)
    differ = []
    for start in (0, 5):
        for m in CHECKED_ROWS:
            want = short if m <= INVARIANT_ROWS else full
            if m <= INVARIANT_ROWS and start + m > INVARIANT_ROWS:
                continue
            got = fmt.product(x[start : start + m], fields, invariant=True)
            if not torch.equal(got, want[start : start + m]):
                differ.append((start, m))
    return differ


class Worker:
    def __init__(self, engine_config: EngineConfig):
        self.config = engine_config
        cuda = engine_config.device.type == "cuda"
        # What this process held before this engine: its own use is what it adds (the
        # caching allocator is shared by every engine in the process).
        self._reserved_before = torch.cuda.memory_reserved(engine_config.device) if cuda else 0
        self.model = load_model(engine_config)
        if engine_config.compilation_config.batch_invariant:
            check_invariant_products(self.model, engine_config)
        if engine_config.device.type == "cpu":
            pack_parameters(self.model)  # before compiling: pieces read weights in place
        backend = select_attention_backend(
            engine_config.device,
            engine_config.cache_config.attention_backend,
            compile_cache_root(engine_config),
            engine_config.cache_config.attention_num_splits,
            bool(engine_config.compilation_config.batch_invariant),
        )
        self.runner = ModelRunner(engine_config, self.model, backend)
        self.compile_seconds = 0.0
        self.activation_peak = 0
        self.own_use = 0  # device bytes this engine held before its KV cache (CUDA)
        self._prepared = False
        self._kv_budget: int | None = None

    def prepare(self) -> None:
        """Everything that takes device memory before the KV cache, once: compile (or
        load), a profiling forward over the token budget, CUDA-graph capture (pieces, and
        the largest whole step as a stand-in). The captures read a one-block placeholder
        cache; init_cache replaces it (attention runs outside the piecewise graphs and
        reads the layer's cache on every call; the whole steps are captured again)."""
        if self._prepared:
            return
        self._prepared = True
        if self.runner.capture_sizes or self.runner.full_graph_sizes:
            self.runner.initialize_kv_cache(1)
        self.compile_seconds = self.runner.warm_up()
        self.activation_peak = self.runner.profile_run()
        self.runner.capture_cuda_graphs()
        # The whole-step graphs' memory, before the KV cache is sized (they are captured
        # again over the real cache, into the memory this stand-in holds).
        self.runner.capture_full_graphs(largest_only=True)

    def kv_budget_bytes(self) -> int:
        cache = self.config.cache_config
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.config.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        if self._kv_budget is None:
            self.prepare()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.config.device)
            self.own_use = torch.cuda.memory_reserved(self.config.device) - self._reserved_before
            self._kv_budget = kv_budget_after_profiling(
                total, cache.gpu_memory_utilization, self.own_use, self.activation_peak, free
            )
        return self._kv_budget

    def num_kv_blocks(self) -> int:
        """How many blocks this rank's budget holds for its own layers."""
        return self.kv_budget_bytes() // max(1, self.runner.kv_cache_bytes_per_block())

    def init_cache(self, num_blocks: int) -> None:
        """Compile, profile and capture the pieces (if num_kv_blocks did not already),
        allocate the KV cache, then capture whole decode steps (they hold its address)."""
        self.prepare()
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_full_graphs()

    def execute(self, plan: StepPlan, feed: Feed | None = None) -> torch.Tensor | None:
        return self.runner.execute(plan, feed)

    def graph_tokens(self) -> torch.Tensor | None:
        """The last step's tokens where its full CUDA graph drew them."""
        return self.runner.graph_tokens
