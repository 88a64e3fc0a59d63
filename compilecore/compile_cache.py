"""The on-disk compile cache: one folder per cache key, one file per compiled piece.

Writes are atomic (write a temporary file, then rename), so two processes compiling the
same model never leave a half-written entry; a corrupt or unreadable entry is reported
once, recompiled and replaced. `COMPILECORE_DISABLE_COMPILE_CACHE=1` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from compilecore.config import EngineConfig, cache_root

logger = logging.getLogger("compilecore")


def cache_disabled() -> bool:
    return os.environ.get("COMPILECORE_DISABLE_COMPILE_CACHE", "0") not in ("", "0", "false")


_TORCH_DIR = str(Path(torch.__file__).parent)


def traced_files(gm: fx.GraphModule) -> list[str]:
    """Source files the Dynamo graph was traced from: every frame Dynamo inlined (a
    helper that steers tracing without emitting an op counts too) and the nodes' stack
    traces. Torch's own files are left out: its version is in the key."""
    files = set()
    context = torch._guards.TracingContext.try_get()
    for code in getattr(context, "traced_code", None) or ():
        files.add(code.co_filename)
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") or ""
        for line in trace.splitlines():
            line = line.strip()
            if line.startswith('File "'):
                files.add(line.split('"')[1])
    return sorted(f for f in files if os.path.isfile(f) and not f.startswith(_TORCH_DIR))


def file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def config_factors(engine_config: EngineConfig, pass_uuid: str) -> dict[str, Any]:
    """What changes the compiled code and is known before tracing."""
    mc, cc, pc = (
        engine_config.model_config,
        engine_config.compilation_config,
        engine_config.parallel_config,
    )
    from compilecore.parallel_state import get_pp_group, get_tp_group

    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else vars(mc.hf_config)
    hf = {k: v for k, v in hf.items() if not k.startswith("_") and k != "transformers_version"}
    return {
        "torch": torch.__version__,
        "device": engine_config.device.type,
        "hf_config": json.dumps(hf, sort_keys=True, default=str),
        "dtype": str(mc.dtype),
        "max_model_len": mc.max_model_len,
        "mode": cc.mode,
        "splitting_ops": list(cc.splitting_ops),
        "compile_sizes": sorted(cc.compile_sizes),
        # the size hint of the unbacked token dimension (decorators._mark_unbacked)
        "size_hint": engine_config.scheduler_config.max_num_batched_tokens,
        "inductor_options": json.dumps(cc.inductor_options, sort_keys=True, default=str),
        "parallel": [pc.tensor_parallel_size, pc.pipeline_parallel_size],
        "rank": [get_tp_group().rank_in_group, get_pp_group().rank_in_group],
        "pass_manager": pass_uuid,
        "compilecore": compilecore_source_hash(),
        "toolchain": toolchain_factors(engine_config.device),
    }


def toolchain_factors(device: torch.device) -> dict[str, Any]:
    """What the artifacts were built for, so a cache shared between machines never loads
    code made for another GPU, CUDA or Triton. (Inductor's settings enter through
    `inductor_options` and the torch version: a hash of its whole global config is not
    stable, since Inductor fills some of it in while compiling.)"""
    factors: dict[str, Any] = {"cuda": torch.version.cuda, "triton": _triton_version()}
    if device.type == "cuda":
        factors["gpu"] = torch.cuda.get_device_name(device)
        factors["capability"] = list(torch.cuda.get_device_capability(device))
    return factors


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@functools.cache
def compilecore_source_hash() -> str:
    """The compile layer's own code: a change to how pieces are split, compiled or
    loaded must not reuse artifacts made by the old code."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def cache_factors(
    engine_config: EngineConfig,
    gm: fx.GraphModule,
    pass_uuid: str,
    files: list[str],
    example_inputs: Sequence[Any] = (),
) -> dict[str, Any]:
    """Everything that changes the compiled code, by name (also shown in dumps). The
    inputs' shapes and dtypes count too: the graph's code names its inputs only, and two
    files of one model whose layers hold different block formats (a Q8_0 and a Q6_K
    layer both trace as `dequantize_q8`) trace to the same code over other weights."""
    sources = hashlib.sha256()
    for path in files:
        sources.update(path.encode() + Path(path).read_bytes())
    return {
        **config_factors(engine_config, pass_uuid),
        "traced_sources": sources.hexdigest(),
        "graph": hashlib.sha256(gm.code.encode()).hexdigest(),
        "inputs": hashlib.sha256(json.dumps(_input_specs(example_inputs)).encode()).hexdigest(),
    }


def _input_specs(example_inputs: Sequence[Any]) -> list[Any]:
    """Each input's dtype, shape and strides (symbolic sizes by name), or its type."""
    return [
        [str(t.dtype), [str(s) for s in t.shape], [str(s) for s in t.stride()]]
        if isinstance(t, torch.Tensor)
        else type(t).__name__
        for t in example_inputs
    ]


def cache_key(factors: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:24]


def compile_cache_root(engine_config: EngineConfig) -> Path:
    base = engine_config.compilation_config.cache_dir
    return Path(base) if base else cache_root() / "torch_compile"


class CacheDirError(RuntimeError):
    """A compile cache folder that someone else could have written code into."""


def check_cache_root(root: Path) -> None:
    """Recipes and artifacts are code that runs when loaded: refuse a cache folder owned
    by another user or writable by everyone (or one inside such a folder)."""
    path = root
    while not path.exists() and path.parent != path:
        path = path.parent
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid() and path == root:
        raise CacheDirError(
            f"the compile cache {root} belongs to uid {info.st_uid}, not to you: its code "
            "would run as you. Use a folder of your own (compilation_config['cache_dir'] or "
            "COMPILECORE_CACHE_DIR)"
        )
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise CacheDirError(
            f"the compile cache {root} (at {path}) is writable by every user: anyone could "
            f"put code there that runs as you. Run `chmod o-w {path}` or use a folder of "
            "your own (compilation_config['cache_dir'] or COMPILECORE_CACHE_DIR)"
        )


def atomic_write(folder: Path, filename: str, write) -> None:
    """`write(tmp_path)`, then rename onto folder/filename: readers never see half a file.
    Raises OSError."""
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=folder)
        os.close(fd)
        write(tmp)
        os.replace(tmp, folder / filename)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _pass_report_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "compilecore_pass_reports"


def save_pass_report(key: str, report: dict[str, Any]) -> None:
    """What the passes did in one compile, kept beside Inductor's FX graph cache: a later
    compile of the same graph under another compilecore cache dir gets Inductor's cached
    code without running the passes, and reads this report instead."""
    try:
        text = json.dumps(report)
        atomic_write(_pass_report_dir(), f"{key}.json", lambda tmp: Path(tmp).write_text(text))
    except OSError as exc:  # a report only: the compile itself is fine
        logger.debug("cannot save the pass report %s: %s", key, exc)


def load_pass_report(key: str) -> dict[str, Any] | None:
    try:
        return json.loads((_pass_report_dir() / f"{key}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


class CompileCache:
    def __init__(self, engine_config: EngineConfig, key: str, tag: str):
        root = compile_cache_root(engine_config)
        self.dir = root / key / tag
        self.enabled = not cache_disabled()
        if self.enabled:
            check_cache_root(root)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.bin"

    def load(self, name: str) -> Any | None:
        """The compiled artifact, or None when absent (or unreadable: then it is reported
        and the caller recompiles and replaces it)."""
        from torch._inductor import CompiledArtifact

        path = self.path(name)
        if not self.enabled or not path.is_file():
            return None
        try:
            return CompiledArtifact.load(path=str(path), format="binary")
        except Exception as e:  # any corruption: truncated file, bad pickle, version skew
            from compilecore.counters import compilation_counter

            compilation_counter.num_cache_errors += 1
            logger.warning("compile cache entry %s is unreadable (%s): recompiling it", path, e)
            path.unlink(missing_ok=True)  # reported once; the recompile writes it anew
            return None

    def save_json(self, name: str, data: Any) -> None:
        if self.enabled:
            self._atomic_write(name + ".json", lambda tmp: Path(tmp).write_text(json.dumps(data)))

    def _write_failed(self, filename: str, exc: OSError) -> None:
        """A read-only or full cache folder: warn once and go on without the cache."""
        logger.warning(
            "cannot write %s to the compile cache %s (%s): running uncached", filename,
            self.dir, exc,
        )  # fmt: skip
        self.enabled = False

    def load_json(self, name: str) -> Any | None:
        path = self.dir / f"{name}.json"
        try:
            return json.loads(path.read_text()) if self.enabled and path.is_file() else None
        except (OSError, json.JSONDecodeError):
            return None

    def _atomic_write(self, filename: str, write) -> None:
        try:
            atomic_write(self.dir, filename, write)
        except OSError as exc:
            self._write_failed(filename, exc)

    def save(self, name: str, artifact: Any) -> None:
        if self.enabled:
            self._atomic_write(f"{name}.bin", lambda tmp: artifact.save(path=tmp, format="binary"))
