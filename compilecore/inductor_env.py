"""Start-up costs of Inductor that a warm start need not pay again.

Inductor decides which vector instruction sets (AVX-512, AVX2, ...) its C++ may use by
compiling a probe per candidate and dlopen-ing it in a fresh Python process, once per
process: about 0.7 s of a warm start on the 2-core build machine, longer than loading
every compiled piece. When every candidate the CPU reports has passed once, we note it
(per CPU, compiler and torch version) and let later processes trust the CPU's flags
(`cpp.vec_isa_ok`), which is what the probes would conclude.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("compilecore")


@functools.cache
def _marker(root: Path) -> Path | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        cpu = [
            ln
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith(("model name", "flags"))
        ][:2]
    except OSError:
        return None
    key = "\n".join([torch.__version__, _compiler_version(), *cpu])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / "inductor" / f"vec_isa_ok_{digest}"


def _compiler_version() -> str:
    """What a probe's result depends on besides the CPU: the C++ compiler Inductor runs."""
    names = [os.environ.get("CXX", ""), *[c for c in torch._inductor.config.cpp.cxx if c]]
    for name in filter(None, names):
        try:
            out = subprocess.run([name, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        return f"{name}: {out.stdout.strip()}"
    return "no compiler found"


def _probes_all_passed() -> bool:
    """Whether this process's probes (if any ran) accepted every ISA the CPU reports."""
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0:
        return False  # nothing probed in this process: nothing learned
    flags = cpu_vec_isa.x86_isa_checker()
    reported = [
        str(isa)
        for isa in cpu_vec_isa.supported_vec_isa_list
        if all(flag in flags for flag in str(isa).split())
    ]
    probed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    return bool(reported) and probed == reported


@contextlib.contextmanager
def trusted_vec_isa(root: Path) -> Iterator[None]:
    """Compile or load Inductor code in this block without re-probing the vector ISAs
    when an earlier process found them all working (noted under `root`, the compile
    cache); otherwise probe and remember."""
    marker = _marker(root)
    if marker is None:
        yield
        return
    if marker.exists():
        with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
            yield
        return
    yield
    try:
        if _probes_all_passed():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    except (AttributeError, ImportError, OSError) as e:  # another torch layout: just probe
        logger.debug("not recording the vector ISA probes: %s", e)
