"""Build and load the CPU attention kernels (`cpu_kernels.cpp`).

g++ compiles the file once per source, flags and CPU into the compile cache directory
(`compilation_config.cache_dir`, by default `~/.cache/compilecore/torch_compile`, under
`kernels/`); later processes load the shared object in milliseconds. The source
has no torch headers, so a cold build takes about a second. Writes go to a temporary file
that is renamed into place, so processes building at the same time never load half a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from compilecore.config import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
FLAGS += ["-shared", "-fPIC", "-std=c++17"]


class KernelBuildError(RuntimeError):
    pass


def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(wanted)


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    return cxx


def library_path(cxx: str, root: Path) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = "\n".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_identity()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / "kernels" / f"cpu_attention_{digest}.so"


def build(cxx: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode:
            raise KernelBuildError(f"{cxx} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_cpu_kernels(root: Path | None = None) -> ctypes.CDLL:
    """The compiled kernels (built on first use under `root`); KernelBuildError says why
    not."""
    cxx = _compiler()
    path = library_path(cxx, root or cache_root() / "torch_compile")
    if not path.exists():
        logger.info("building CPU attention kernels with %s -> %s", cxx, path)
        build(cxx, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:  # a truncated or foreign file: rebuild once
        logger.warning("CPU attention kernels at %s failed to load (%s); rebuilding", path, exc)
        build(cxx, path)
        lib = ctypes.CDLL(str(path))
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for name in ("f32", "bf16"):
        write = getattr(lib, f"write_kv_{name}")
        write.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64]
        write.restype = None
        decode = getattr(lib, f"decode_{name}")
        decode.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64] + [i64] * 5 + [f32, i64]
        decode.restype = None
    lib.max_group_dims.restype = i64
    lib.max_group.restype = i64
