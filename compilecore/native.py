"""Build a small C++ source into a shared object in the compile cache and load it.

Used for code that has no torch headers (the CPU attention kernels, the CPU-graph
executor): g++ builds it in about a second, once per source, flags, compiler and CPU;
later processes load it in milliseconds. Writes go to a temporary file renamed into
place, so processes building at the same time never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("compilecore")

FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
FLAGS += ["-shared", "-fPIC", "-std=c++17"]


class KernelBuildError(RuntimeError):
    pass


def cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(wanted)


def compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    return cxx


def library_path(cxx: str, source: str, name: str, root: Path, flags: list[str]) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = "\n".join([source, " ".join(flags), version, cpu_identity(), "link apart"])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / "kernels" / f"{name}_{digest}.so"


def build(cxx: str, source: str, name: str, target: Path, flags: list[str]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    src, obj = Path(tmp).with_suffix(".cpp"), Path(tmp).with_suffix(".o")
    # Compile and link apart: linking with -ffast-math pulls in crtfastmath.o, whose
    # constructor switches the whole process to flush-to-zero / denormals-are-zero the
    # moment the library is loaded, changing every other float computation in it.
    compile_flags = [f for f in flags if f != "-shared"]
    link_flags = ["-shared"] + [f for f in flags if f in ("-fopenmp", "-fPIC")]
    try:
        src.write_text(source)
        for cmd in (
            [cxx, *compile_flags, "-c", str(src), "-o", str(obj)],
            [cxx, *link_flags, str(obj), "-o", tmp],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise KernelBuildError(f"{cxx} failed to build {name}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, src, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)


def load_library(source: str, name: str, root: Path, flags: list[str] = FLAGS) -> ctypes.CDLL:
    """The shared object built from `source` (built on first use under `root/kernels`);
    KernelBuildError says why not."""
    cxx = compiler()
    path = library_path(cxx, source, name, root, flags)
    if not path.exists():
        logger.info("building %s with %s -> %s", name, cxx, path)
        build(cxx, source, name, path, flags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:  # a truncated or foreign file: rebuild once
        logger.warning("%s at %s failed to load (%s); rebuilding", name, path, exc)
        build(cxx, source, name, path, flags)
        return ctypes.CDLL(str(path))
