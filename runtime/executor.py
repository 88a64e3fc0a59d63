"""Executors run a step plan on every rank and hand rank 0's logits back to the engine.

`LocalExecutor`: one process. `MultiprocExecutor`: tensor x pipeline parallel ranks on
torch.distributed (gloo on CPU, NCCL on CUDA). The driver (the user's process) is global
rank 0: it schedules, samples and detokenizes, and also runs its own shard. Other ranks
are either spawned here (one machine) or started by torchrun (`runtime.launch`); they
receive each step's plan by broadcast and run their shard in lock step.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from compilecore.config import EngineConfig
from compilecore.parallel_state import (
    GroupCoordinator,
    get_pp_group,
    get_tp_group,
    init_model_parallel,
    init_parallel_state,
)
from runtime.async_scheduling import Feed
from runtime.model_runner import StepPlan
from runtime.worker import Worker

logger = logging.getLogger("compilecore")


class WorkerError(RuntimeError):
    pass


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` made the current CUDA device for a block (nothing elsewhere): Triton
    launches, CUDA-graph capture and the current stream all follow the current device,
    not the tensors', so `LLM(device="cuda:1")` captured and launched on cuda:0 before."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class LocalExecutor:
    def __init__(self, engine_config: EngineConfig):
        if get_tp_group().world_size > 1 or get_pp_group().world_size > 1:
            raise RuntimeError(
                "a tensor/pipeline-parallel LLM is still running in this process (the parallel "
                "state is global): call its shutdown() before creating another LLM"
            )
        # Each call enters the device, not set_device once: two engines on two GPUs in
        # one process each run on their own.
        self.device = engine_config.device
        with on_device(self.device):
            self.worker = Worker(engine_config)

    def num_kv_blocks(self) -> int:
        with on_device(self.device):
            return self.worker.num_kv_blocks()

    def init_cache(self, num_blocks: int) -> None:
        with on_device(self.device):
            self.worker.init_cache(num_blocks)

    def execute(self, plan: StepPlan, feed: Feed | None = None) -> torch.Tensor | None:
        with on_device(self.device):
            return self.worker.execute(plan, feed)

    def graph_tokens(self) -> torch.Tensor | None:
        return self.worker.graph_tokens()

    def shutdown(self) -> None:
        pass


def validate_parallel_config(engine_config: EngineConfig) -> None:
    """Start-up checks, before any process is started, each naming what to change."""
    from models.interfaces import supports_pp
    from models.registry import resolve_model_class

    pc, hf = engine_config.parallel_config, engine_config.model_config.hf_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size ({tp})"
        )
    if kv < tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must be a multiple of num_key_value_heads ({kv}) "
            "to replicate the KV heads"
        )
    if kv >= tp and kv % tp:
        raise ValueError(
            f"num_key_value_heads ({kv}) must be divisible by tensor_parallel_size ({tp})"
        )
    cls = resolve_model_class(engine_config.model_config.architecture)
    if pp > 1 and not supports_pp(cls):
        raise ValueError(f"{cls.__name__} does not support pipeline parallelism (SupportsPP)")
    if pp > hf.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size ({pp}) is larger than the model's "
            f"{hf.num_hidden_layers} layers"
        )
    if engine_config.device.type == "cuda" and pc.world_size > torch.cuda.device_count():
        raise ValueError(
            f"{pc.world_size} ranks need {pc.world_size} GPUs; found {torch.cuda.device_count()}"
        )


def dist_timeout() -> timedelta:
    """How long a collective may wait for a silent rank before it fails."""
    return timedelta(seconds=float(os.environ.get("COMPILECORE_DIST_TIMEOUT", "60")))


def init_distributed(engine_config: EngineConfig, rank: int, world: int, init_method: str) -> None:
    backend = "nccl" if engine_config.device.type == "cuda" else "gloo"
    if engine_config.device.type == "cuda":
        torch.cuda.set_device(engine_config.device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=dist_timeout()
    )
    pc = engine_config.parallel_config
    init_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)


def agree_on_blocks(worker: Worker) -> int:
    """Every rank's cache must have the same number of blocks: take the smallest."""
    blocks = torch.tensor([worker.num_kv_blocks()], dtype=torch.long)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=_cpu_group())
    return int(blocks.item())


def _cpu_group():
    # Plans and block counts travel on a gloo group even when tensors use NCCL.
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=dist_timeout())
    return _CPU_GROUP


_CPU_GROUP = None


def for_rank(engine_config: EngineConfig, rank: int) -> EngineConfig:
    if engine_config.device.type == "cuda":
        engine_config.device = torch.device("cuda", rank % torch.cuda.device_count())
    return engine_config


def run_worker(engine_config: EngineConfig, rank: int, world: int, init_method: str) -> None:
    """A non-driver rank: build its shard, then run every broadcast plan until told to stop."""
    engine_config = for_rank(engine_config, rank)
    init_distributed(engine_config, rank, world, init_method)
    worker = Worker(engine_config)
    worker.init_cache(agree_on_blocks(worker))
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=_cpu_group())
            if box[0] is None:
                break
            worker.execute(box[0])
    finally:
        dist.destroy_process_group()


def _spawned_worker(engine_config, rank, world, init_method, errors) -> None:
    try:
        run_worker(engine_config, rank, world, init_method)
    except BaseException as e:  # report the cause to the driver, then die
        errors.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    def __init__(self, engine_config: EngineConfig, external: bool = False):
        pc = engine_config.parallel_config
        self.world = pc.world_size
        self.procs: list[mp.Process] = []
        self.errors = None
        if external:  # torchrun started every rank; this is rank 0
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            self.errors = ctx.Queue()
            for rank in range(1, self.world):
                p = ctx.Process(
                    target=_spawned_worker,
                    daemon=True,
                    name=f"compilecore-rank{rank}",
                    args=(engine_config, rank, self.world, init_method, self.errors),
                )
                p.start()
                self.procs.append(p)
        try:
            init_distributed(for_rank(engine_config, 0), 0, self.world, init_method)
            self.worker = Worker(engine_config)
        except BaseException as e:
            raise self._failure(e) from e

    def num_kv_blocks(self) -> int:
        try:
            return agree_on_blocks(self.worker)
        except BaseException as e:
            raise self._failure(e) from e

    def init_cache(self, num_blocks: int) -> None:
        try:
            self.worker.init_cache(num_blocks)
        except BaseException as e:
            raise self._failure(e) from e

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        self._check_workers()
        try:
            dist.broadcast_object_list([plan], src=0, group=_cpu_group())
            return self.worker.execute(plan)
        except BaseException as e:
            raise self._failure(e) from e

    def graph_tokens(self) -> torch.Tensor | None:
        return self.worker.graph_tokens()  # the driver's (rank 0 holds the logits)

    def _check_workers(self) -> None:
        if any(not p.is_alive() for p in self.procs):
            raise self._failure(None)

    def _reported_or_dead(self) -> tuple[int, str] | None:
        if self.errors is not None:
            try:
                return self.errors.get_nowait()
            except queue.Empty:
                pass
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return rank, f"process exited with code {p.exitcode}"
        return None

    def _failure(self, error: BaseException | None) -> WorkerError:
        """Name the rank that failed and why, then stop every rank (no orphans)."""
        cause, deadline = None, time.monotonic() + 5.0
        while cause is None and time.monotonic() < deadline and self.procs:
            cause = self._reported_or_dead()
            if cause is None:
                time.sleep(0.1)
        if cause is None:
            cause = (0, f"{type(error).__name__}: {error}")
        self.shutdown(force=True)
        rank, text = cause
        return WorkerError(f"rank {rank} failed: {text.strip()}")

    def shutdown(self, force: bool = False) -> None:
        if not force and dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0, group=_cpu_group())
            except Exception:  # a rank is already gone: stop the rest below
                force = True
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
        global _CPU_GROUP
        _CPU_GROUP = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # peers already gone
                logger.debug("destroy_process_group: %s", e)
        init_parallel_state(GroupCoordinator(), GroupCoordinator())
