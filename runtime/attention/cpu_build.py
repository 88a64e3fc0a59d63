"""Build and load the CPU attention kernels (`cpu_kernels.cpp`: KV writes and decode;
`cpu_prefill.cpp`: prefill chunks).

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
from passes.native import KernelBuildError, declare, load_library, op_source

__all__ = ["KernelBuildError", "load_cpu_kernels"]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill.cpp")


@functools.cache
def load_cpu_kernels(root: Path | None = None) -> ctypes.CDLL:
    """The compiled kernels (built on first use under `root`); KernelBuildError says why
    not."""
    lib = load_library(SOURCE.read_text(), "cpu_attention", root or cache_root() / "torch_compile")
    _declare(lib)
    return lib


@functools.cache
def load_prefill_kernel(root: Path | None = None) -> ctypes.CDLL | None:
    """The prefill kernel where this CPU's build has it (AVX512-BF16), else None."""
    source = op_source(PREFILL_SOURCE)  # with passes/ops/exp16.h pasted in
    lib = load_library(source, "cpu_prefill", root or cache_root() / "torch_compile")
    signature = "prefill_bf16(ptr, i64, ptr, ptr, ptr, i64 x2, ptr, i64 x5, f32, i64) -> i64"
    declare(lib, "prefill_built() -> i64", signature)
    return lib if lib.prefill_built() else None


def _declare(lib: ctypes.CDLL) -> None:
    for name in ("f32", "bf16"):
        declare(
            lib,
            f"write_kv_{name}(ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64)",
            f"decode_{name}(ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64 x6, f32, i64 x2)",
        )
    declare(lib, "decode_team_states(i64 x4) -> i64", "decode_parts(i64 x3) -> i64",
            "max_group_dims() -> i64", "max_group() -> i64")  # fmt: skip
