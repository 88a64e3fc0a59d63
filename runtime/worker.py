"""One rank's share of the work: its model shard, KV cache and runner."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from compilecore.compile_cache import compile_cache_root
from compilecore.config import EngineConfig
from models.loader import load_model
from runtime.attention import TorchPagedAttentionBackend
from runtime.attention.cpu_build import KernelBuildError, load_cpu_kernels
from runtime.attention.cpu_paged import CpuPagedAttentionBackend
from runtime.attention.triton_paged import TritonPagedAttentionBackend, triton_usable
from runtime.huge_pages import pack_parameters
from runtime.model_runner import ModelRunner, StepPlan

logger = logging.getLogger("compilecore")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
BACKENDS = ("auto", "torch", "cpu", "triton")


def select_attention_backend(
    device: torch.device, requested: str = "auto", cache_dir: Path | None = None
) -> Any:
    """Triton on CUDA, the C++ kernels on CPU (torch if they cannot be built), unless the
    config or the environment forces one."""
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
        raise ValueError(
            "the Triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 to run "
            "its kernels in the interpreter); use attention_backend='torch'"
        )
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU tensors, not {device.type}")
    logger.info("attention backend: %s on %s", choice, device.type)
    if choice == "cpu":
        return CpuPagedAttentionBackend(cache_dir=cache_dir)
    return TritonPagedAttentionBackend() if choice == "triton" else TorchPagedAttentionBackend()


def cpu_kernels_usable(cache_dir: Path | None = None) -> bool:
    try:
        load_cpu_kernels(cache_dir)
    except KernelBuildError as exc:
        logger.warning("CPU attention kernels unavailable, using the torch backend: %s", exc)
        return False
    return True


class Worker:
    def __init__(self, engine_config: EngineConfig):
        self.config = engine_config
        self.model = load_model(engine_config)
        if engine_config.device.type == "cpu":
            pack_parameters(self.model)  # before compiling: pieces read weights in place
        backend = select_attention_backend(
            engine_config.device,
            engine_config.cache_config.attention_backend,
            compile_cache_root(engine_config),
        )
        self.runner = ModelRunner(engine_config, self.model, backend)
        self.compile_seconds = 0.0

    def kv_budget_bytes(self) -> int:
        cache = self.config.cache_config
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.config.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.config.device)
            return int(free - (1 - cache.gpu_memory_utilization) * total)
        return DEFAULT_CPU_KV_CACHE_BYTES

    def num_kv_blocks(self) -> int:
        """How many blocks this rank's budget holds for its own layers."""
        return self.kv_budget_bytes() // max(1, self.runner.kv_cache_bytes_per_block())

    def init_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, compile (or load) the model, capture CUDA graphs."""
        self.runner.initialize_kv_cache(num_blocks)
        self.compile_seconds = self.runner.warm_up()
        self.runner.capture_cuda_graphs()

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        return self.runner.execute(plan)
