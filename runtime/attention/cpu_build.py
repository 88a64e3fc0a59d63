"""Build and load the CPU attention kernels (`cpu_kernels.cpp`).

g++ compiles the file once per source, flags and CPU into the compile cache directory
(`compilation_config.cache_dir`, by default `~/.cache/compilecore/torch_compile`, under
`kernels/`; see `passes.native`). The source has no torch headers, so a cold build
takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from compilecore.config import cache_root
from passes.native import KernelBuildError, load_library

__all__ = ["KernelBuildError", "load_cpu_kernels"]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")


@functools.cache
def load_cpu_kernels(root: Path | None = None) -> ctypes.CDLL:
    """The compiled kernels (built on first use under `root`); KernelBuildError says why
    not."""
    lib = load_library(SOURCE.read_text(), "cpu_attention", root or cache_root() / "torch_compile")
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
    lib.decode_team_states.argtypes = [i64] * 4
    lib.decode_team_states.restype = i64
    lib.decode_parts.argtypes = [i64, i64, i64]
    lib.decode_parts.restype = i64
    lib.max_group_dims.restype = i64
    lib.max_group.restype = i64
