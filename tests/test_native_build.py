"""The native build's cache key: a build made with `-march=native` on one CPU must never
be loaded on another, on x86 and Arm alike."""

from __future__ import annotations

import shutil

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
