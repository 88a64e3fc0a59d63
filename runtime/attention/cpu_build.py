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
from passes.native import FLAGS, KernelBuildError, declare, load_library, op_source

__all__ = ["KernelBuildError", "load_cpu_kernels"]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill.cpp")


@functools.cache
def load_cpu_kernels(root: Path | None = None) -> ctypes.CDLL:
    """The compiled kernels (built on first use under `root`); KernelBuildError says why
    not."""
    return build_cpu_kernels(root or cache_root() / "torch_compile")


def build_cpu_kernels(root: Path, flags: list[str] = FLAGS) -> ctypes.CDLL:
    """`cpu_kernels.cpp` built with `flags` (a test builds another CPU's level)."""
    source = op_source(SOURCE)  # with passes/ops/fvec.h pasted in
    lib = load_library(source, "cpu_attention", root, flags)
    _declare(lib)
    return lib


@functools.cache
def load_prefill_kernel(root: Path | None = None) -> ctypes.CDLL | None:
    """The prefill kernels where this CPU's build has them (AVX2 or AVX-512), else None."""
    lib = build_prefill_kernel(root or cache_root() / "torch_compile")
    return lib if lib.prefill_built() else None


def build_prefill_kernel(root: Path, flags: list[str] = FLAGS) -> ctypes.CDLL:
    """`cpu_prefill.cpp` built with `flags` (a test builds another CPU's level)."""
    source = op_source(PREFILL_SOURCE)  # with passes/ops' headers pasted in
    lib = load_library(source, "cpu_prefill", root, flags)
    args = "ptr, i64, ptr, ptr, ptr, i64 x2, ptr, i64 x5, f32, i64"
    declare(lib, "prefill_built() -> i64", "prefill_head_size(i64) -> i64",
            f"prefill_bf16({args}) -> i64", f"prefill_f32({args}) -> i64")  # fmt: skip
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
