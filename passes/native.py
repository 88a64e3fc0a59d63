"""Native code without torch headers: build it (compile cache, flags, CPU keys).

Building: g++ compiles a small C++ source (the packed GEMM here, the CPU attention
kernels, the CPU-graph executor) in about a second, once per source, flags, compiler and
CPU, into a cache folder; later processes load it in milliseconds. Writes go to a
temporary file renamed into place, so processes building at the same time never load half
a file.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from passes import prefetch

logger = logging.getLogger("compilecore")


FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
FLAGS += ["-shared", "-fPIC", "-std=c++17"]


class KernelBuildError(RuntimeError):
    pass


def cache_root() -> Path:
    """Where compilecore keeps converted models, compiled artifacts and native code:
    $COMPILECORE_CACHE_DIR, else $XDG_CACHE_HOME/compilecore or ~/.cache/compilecore."""
    env = os.environ.get("COMPILECORE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compilecore"


# The /proc/cpuinfo fields that name a CPU and its features: x86's, then Arm's (which has
# no "model name" or "flags"; there a key of x86's fields alone was the same for every
# generation, and a cache shared across them could load a build that faults).
_CPUINFO_KEYS = ("model name", "flags", "CPU implementer", "CPU architecture", "CPU variant",
                 "CPU part", "CPU revision", "Features", "isa", "uarch")  # fmt: skip


def cpu_identity(cpuinfo: str | None = None) -> str:
    """What `-march=native` depends on: the CPU's model and feature fields (the first of
    each in `cpuinfo`, /proc/cpuinfo's text by default)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or platform.machine()
    found: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in _CPUINFO_KEYS:
            found.setdefault(key, line.strip())
    return "\n".join([platform.machine(), *found.values()])


@functools.cache
def native_target(cxx: str) -> str:
    """The compiler's own expansion of `-march=native` on this machine (the architecture
    and each feature it enables): what a build depends on, whatever /proc/cpuinfo says."""
    try:
        proc = subprocess.run(
            [cxx, "-march=native", "-E", "-v", "-x", "c++", os.devnull, "-o", os.devnull],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [ln.strip() for ln in proc.stderr.splitlines() if "cc1" in ln]
    return "\n".join(lines) or f"unknown (exit {proc.returncode})"


def compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    return cxx


def library_path(cxx: str, source: str, name: str, root: Path, flags: list[str]) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = "\n".join(
        [source, " ".join(flags), version, cpu_identity(), native_target(cxx), "link apart"]
    )
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
        try:
            build(cxx, source, name, path, flags)
        except OSError as exc:  # a read-only or full cache: build for this process only
            logger.warning("cannot write %s (%s): building it in a temporary folder", path, exc)
            folder = tempfile.mkdtemp(prefix="compilecore-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)  # loaded by then
            path = Path(folder) / path.name
            build(cxx, source, name, path, flags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:  # a truncated or foreign file: rebuild once
        logger.warning("%s at %s failed to load (%s); rebuilding", name, path, exc)
        build(cxx, source, name, path, flags)
        return ctypes.CDLL(str(path))


# Row lengths from which a kernel's product gets a fully unrolled copy of its own: the ~1 KB
# rows of a real model's layers, where a loop exit per row costs (docs/kernel-choices.md,
# Quantized row products); smaller rows (test models) share the one generic build.
UNROLL_MIN_K, UNROLL_MAX_K = 256, 16384


def unrolled_sizes(*sizes: int) -> tuple[int, ...]:
    """The row lengths among `sizes` that an op's kernel is worth building unrolled for."""
    return tuple(sorted({k for k in sizes if UNROLL_MIN_K <= k <= UNROLL_MAX_K}))


# The C types a native library's functions take, by the short names signatures use.
_C_TYPES = {
    "i64": ctypes.c_int64,
    "f32": ctypes.c_float,
    "ptr": ctypes.c_void_p,
    "i64*": ctypes.POINTER(ctypes.c_int64),
    "f64*": ctypes.POINTER(ctypes.c_double),
}
_SIGNATURE = re.compile(r"(\w+)\(([^)]*)\)(?:\s*->\s*(\S+))?")


def declare(lib: ctypes.CDLL, *signatures: str) -> ctypes.CDLL:
    """Give `lib`'s functions their C argument and result types, each written once as
    "name(ptr, i64, f32) -> i64" ("i64 x7": seven of them; no "->": no result). Every
    loader of a native library declares its functions this way, beside the load."""
    for signature in signatures:
        match = _SIGNATURE.fullmatch(signature.strip())
        if match is None:
            raise ValueError(f"not a signature: {signature!r}")
        name, params, result = match.groups()
        types = []
        for param in filter(None, (p.strip() for p in params.split(","))):
            kind, _, count = param.partition(" x")
            types += [_C_TYPES[kind]] * int(count or 1)
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = types, None if result is None else _C_TYPES[result]
    return lib


COMMON_HEADER = Path(__file__).parent / "ops" / "cc_common.h"


# `#include "NAME"` of a file under passes/ops/ (`cc_common.h`, `quant/rows_bf16.h`).
_OWN_INCLUDE = re.compile(r'#include "([\w./]+)"')


def op_source(source: Path | str, read: Callable[[str], str] | None = None) -> str:
    """`source`'s text (a file, or the text itself) with each `#include "NAME"` of a file
    under passes/ops/ replaced by that file's text, recursively: the build is keyed by the
    text it compiles, so editing any included file rebuilds every kernel that includes it.
    `read(NAME)` gives an included file's text (default: the working tree's; an A/B
    against a git revision reads that revision's)."""
    folder = COMMON_HEADER.parent
    if read is None:

        def read(name: str) -> str:
            return (folder / name).read_text()

    def inline(match: re.Match) -> str:
        if not (folder / match[1]).exists():
            return match[0]  # a system header written with quotes: left to the compiler
        return op_source(read(match[1]), read)

    text = source.read_text() if isinstance(source, Path) else source
    return _OWN_INCLUDE.sub(inline, text)


def load_op_kernel(
    source: Path, available: str, dot_sizes: Sequence[int] = (), signatures: Sequence[str] = ()
) -> ctypes.CDLL | None:
    """An op's optional kernel: the library built from `source` (named after the file),
    its functions typed by `signatures` (`declare`), or None where it cannot be built or
    its `available()` says this CPU lacks what it needs; callers then take their fallback.
    `dot_sizes`: row lengths the source's `CC_DOT_SIZES` list gets (`CC_DOT(576)
    CC_DOT(1536)`), one build per list; its `CC_PREFETCH` is
    `passes.prefetch.weight_prefetch_bytes()`."""
    flags = FLAGS + [f"-DCC_PREFETCH={prefetch.weight_prefetch_bytes()}"]
    if dot_sizes:
        flags += ["-DCC_DOT_SIZES=" + " ".join(f"CC_DOT({k})" for k in dot_sizes)]
    try:
        lib = load_library(op_source(source), source.stem, cache_root() / "torch_compile", flags)
    except (OSError, KernelBuildError):
        return None
    return declare(lib, *signatures) if getattr(lib, available)() else None
