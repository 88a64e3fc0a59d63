"""The CLI from a subprocess, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
    )


@pytest.mark.slow
def test_generate_with_default_model():
    res = _cli("generate", "--eager", "--max-tokens", "12", "-v", "What is the capital of France?")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "tokens, first after" in res.stderr


def test_generate_with_a_model_folder(tiny_llama):
    res = _cli(
        "generate", "--model", str(tiny_llama[0]), "--eager", "--raw", "--max-tokens", "5", "abc"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.endswith("\n") and res.stderr.count("Traceback") == 0


def test_chat_keeps_the_conversation(tiny_llama):
    res = _cli(
        "chat", "--model", str(tiny_llama[0]), "--eager", "--max-tokens", "3", stdin="hi\nagain\n"
    )
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.strip().splitlines()) >= 1


def test_bad_arguments_give_a_clear_error(tiny_llama):
    res = _cli("generate", "--model", str(tiny_llama[0]), "--top-p", "2", "x")
    assert res.returncode == 2 and "top_p must be in (0, 1]" in res.stderr
    res = _cli("generate", "--model", "/no/such/folder", "x")
    assert res.returncode == 2 and "/no/such/folder" in res.stderr


def test_help_explains_the_commands():
    res = _cli("--help")
    assert res.returncode == 0 and "generate" in res.stdout and "chat" in res.stdout
    res = _cli("generate", "--help")
    assert "--temperature" in res.stdout and "SmolLM2" in res.stdout


def test_dump_takes_python_pass_names_and_every_switch():
    from passes.config import PassConfig
    from runtime.cli import build_parser, dump_passes

    args = build_parser().parse_args(
        ["dump", "--out", "x", "--passes", "fuse_add_rms_norm", "qkv_rope",
         "--no-passes", "gemv_to_reduction", "--verify"]
    )  # fmt: skip
    passes = dump_passes(args)
    assert passes == {"verify": True, "fuse_add_rms_norm": True, "fuse_qkv_rope": True,
                      "gemv_to_reduction": False}  # fmt: skip
    PassConfig.from_any(passes)  # the names Python takes
