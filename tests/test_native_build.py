"""The native build's cache key: a build made with `-march=native` on one CPU must never
be loaded on another, on x86 and Arm alike; and every kernel source compiles for every x86
level, whichever CPU runs the tests."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from passes import native

GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""  # noqa: E501
# Graviton3: another core (Neoverse V1) with SVE and bf16.
GRAVITON3 = GRAVITON2.replace("0xd0c", "0xd40").replace("ssbs", "ssbs sve bf16 i8mm")


def test_arm_generations_get_different_keys():
    """Arm's /proc/cpuinfo has no "model name" or "flags": a key made of those alone was
    the same on every Arm CPU."""
    a, b = native.cpu_identity(GRAVITON2), native.cpu_identity(GRAVITON3)
    assert a != b
    assert "CPU part\t: 0xd0c" in a and "sve" in b


def test_x86_key_takes_the_first_cpus_model_and_flags():
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: avx2\n\nprocessor\t: 1\nmodel name\t: X\n"
    assert native.cpu_identity(text).splitlines()[1:] == ["model name\t: X", "flags\t\t: avx2"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
def test_the_compilers_expansion_of_march_native_is_in_the_key():
    """The compiler says what -march=native means here (the part of the key that holds
    whatever /proc/cpuinfo calls its fields)."""
    target = native.native_target("g++")
    assert "-march=" in target or "-mcpu=" in target or "target-cpu" in target
    assert native.native_target("no-such-compiler-here").startswith("unknown")


def test_the_shared_header_is_part_of_every_kernels_source(tmp_path, monkeypatch):
    """Kernels include cc_common.h; the build is keyed by the text it compiles, so the
    header is pasted in: an edit to it must give every kernel a new library."""
    source = tmp_path / "k.cpp"
    source.write_text('#include "cc_common.h"\nint k() { return 1; }\n')
    text = native.op_source(source)
    assert '#include "cc_common.h"' not in text and "inline Share share(" in text
    header = tmp_path / "cc_common.h"
    header.write_text(native.COMMON_HEADER.read_text() + "// edited\n")
    monkeypatch.setattr(native, "COMMON_HEADER", header)
    edited = native.op_source(source)
    assert edited != text
    paths = [native.library_path("cc", t, "k", tmp_path, ["-O2"]) for t in (text, edited)]
    assert paths[0] != paths[1]


def test_included_files_are_pasted_in_recursively(tmp_path, monkeypatch):
    """quant_kernels.cpp includes its parts (`quant/rows_bf16.h`, ...), which may include
    others: every one is pasted in, so an edit to any of them gives a new library; a quoted
    include of a file that is not ours is left to the compiler; an A/B's reader gives
    another revision's text for the same names."""
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "a.h").write_text('int a() { return 1; }\n#include "quant/b.h"\n')
    (tmp_path / "quant" / "b.h").write_text("int b() { return 2; }\n")
    monkeypatch.setattr(native, "COMMON_HEADER", tmp_path / "cc_common.h")
    source = '#include "quant/a.h"\n#include "stdio.h"\nint k() { return a() + b(); }\n'
    text = native.op_source(source)
    assert text == ('int a() { return 1; }\nint b() { return 2; }\n\n\n'
                    '#include "stdio.h"\nint k() { return a() + b(); }\n')  # fmt: skip
    other = native.op_source(source, lambda name: f"// {name} at another revision\n")
    assert other.startswith("// quant/a.h at another revision\n")
    (tmp_path / "quant" / "b.h").write_text("int b() { return 3; }\n")
    assert native.op_source(source) != text


def test_the_quant_kernels_source_is_whole():
    """Every part of quant_kernels.cpp is pasted in (no include of ours left), and each
    part is included once."""
    text = native.op_source(Path(native.__file__).parent / "ops" / "quant_kernels.cpp")
    assert '#include "quant/' not in text and '#include "cc_common.h"' not in text
    for part in ("hsum8", "row_product_q4_bf16", "strip_rows_int8", "dequantize_team"):
        assert text.count(f" {part}(") >= 1
    assert text.count("inline float f16_f32(") == 1


def test_declare_types_a_librarys_functions_from_one_line_each():
    """Every native library's functions are typed by `native.declare` signatures: a
    count ("i64 x3"), pointers, a result; a malformed signature is an error, not a
    function left with ctypes' default int (32-bit) arguments."""
    import ctypes

    libc = ctypes.CDLL(None)
    native.declare(libc, "labs(i64) -> i64", "memcpy(ptr x2, i64) -> ptr", "abort()")
    assert libc.labs.argtypes == [ctypes.c_int64] and libc.labs.restype is ctypes.c_int64
    assert libc.labs(-(1 << 40)) == 1 << 40  # 64 bits through the call
    assert libc.memcpy.argtypes == [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    assert libc.abort.argtypes == [] and libc.abort.restype is None
    with pytest.raises(ValueError, match="not a signature"):
        native.declare(libc, "labs i64")


# The x86 levels the kernels' #if branches select between: none (portable), AVX2 + FMA
# (Zen 1-3), AVX-512 without bf16 (Ice Lake servers: VNNI), AVX512-BF16 (Zen 4, Cooper
# Lake), AMX (Sapphire Rapids). A session on one CPU builds only its own level.
X86_LEVELS = ("x86-64", "haswell", "icelake-server", "cooperlake", "sapphirerapids")
KERNEL_SOURCES = ("passes/ops/gemv.cpp", "passes/ops/layer_kernels.cpp",
                  "passes/ops/packed_mm.cpp", "passes/ops/quant_kernels.cpp",
                  "runtime/attention/cpu_kernels.cpp", "runtime/attention/cpu_prefill.cpp",
                  "runtime/cpu_sampling.cpp")  # fmt: skip


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ for x86-64")
@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_every_kernel_compiles_for_every_x86_level(source, tmp_path):
    """Each C++ source compiles for every x86 level, not only this CPU's: a name used
    outside the #if branch that defines it once left every AVX-512 CPU (and the portable
    build) without the quantized kernels, unseen on the AVX2 machine where it was written
    (`-fsyntax-only`: no code generated, ~1 s a level)."""
    root = Path(native.__file__).parents[1]
    text = tmp_path / Path(source).name
    text.write_text(native.op_source(root / source))
    flags = [f for f in native.FLAGS if not f.startswith("-march")]
    flags += ["-DCC_PREFETCH=0", "-DCC_DOT_SIZES=CC_DOT(576)", "-fsyntax-only"]
    failed = {}
    for level in X86_LEVELS:
        run = subprocess.run(["g++", *flags, f"-march={level}", str(text)],
                             capture_output=True, text=True)  # fmt: skip
        if run.returncode:
            failed[level] = [line for line in run.stderr.splitlines() if "error" in line][:3]
    assert not failed, failed


def _functions(library: str) -> dict[str, str]:
    """The library's disassembly, function by function (objdump -d)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    parts = re.split(r"^[0-9a-f]+ <(.+)>:$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")
def test_the_row_products_keep_their_weight_prefetch():
    """Every built row-product loop on AVX-512 (the one-row loops and the row products
    left out of line) prefetches its weights: GCC 12 dropped `prefetch_weights`' prefetch
    inside the forced-inline int8 products while it was a plain inline helper, and the
    loops read from DRAM 0.72-0.92x with no test failing (docs/kernel-choices.md)."""
    from passes.ops import quantized

    lib = quantized._kernel()
    if lib is None:
        pytest.skip("the quant kernels do not build here")
    kinds = ("one_row_loop", "q4_int8", "q6_int8", "q4_bf16")  # (Q8_0's int8 rows do not)
    loops = {name: body for name, body in _functions(lib._name).items()
             if any(kind in name for kind in kinds)
             and re.search(r"(vpdpbusd|vdpbf16ps) .*%zmm", body)}  # fmt: skip
    if not loops:
        pytest.skip("no AVX-512 row products in this build (an AVX2 CPU)")
    missing = [name for name, body in loops.items() if "prefetcht0" not in body]
    assert not missing, missing
