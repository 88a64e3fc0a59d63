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
from passes.native import KernelBuildError, declare, load_library

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
    for name in ("f32", "bf16"):
        declare(
            lib,
            f"write_kv_{name}(ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64)",
            f"decode_{name}(ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64 x6, f32, i64 x2)",
        )
    declare(lib, "decode_team_states(i64 x4) -> i64", "decode_parts(i64 x3) -> i64",
            "max_group_dims() -> i64", "max_group() -> i64")  # fmt: skip
