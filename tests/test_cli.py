"""The CLI as a user runs it: from a subprocess where the process matters (a model
runs, a server starts), through `main` in this process for arguments and help."""

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
    # fp32: the first token is a near-tie ("The" over "L" by 0.08 logits in fp32, under
    # one bf16 step at that size); under torch 2.11 the bf16 eager engine, within bf16
    # rounding of HF, picks "L". tests/test_default_model.py checks bf16 against HF with
    # a margin.
    args = ("--eager", "--dtype", "float32", "--max-tokens", "12", "-v")
    res = _cli("generate", *args, "What is the capital of France?")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "tokens, first after" in res.stderr


def test_generate_with_a_model_folder(tiny_llama):
    # vLLM's spellings of the engine flags work alongside ours.
    res = _cli(
        "generate", "--model", str(tiny_llama[0]), "--enforce-eager", "--raw", "--max-tokens",
        "5", "--max-num-seqs", "4", "-tp", "1", "--no-enable-prefix-caching",
        "--trust-remote-code", "--gpu-memory-utilization", "0.5", "abc",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.endswith("\n") and res.stderr.count("Traceback") == 0


def test_serve_takes_a_vllm_serve_command_line():
    from runtime.cli import _engine_args, build_parser

    line = "serve /models/x --tensor-parallel-size 2 -pp 1 --gpu-memory-utilization 0.8 "
    line += "--max-num-seqs 8 --max-num-batched-tokens 512 --block-size 32 --enforce-eager "
    line += "--no-enable-prefix-caching --trust-remote-code --api-key k --port 9000 "
    line += "--disable-log-requests --disable-log-stats --uvicorn-log-level info "
    line += "--async-scheduling"
    args = build_parser().parse_args(line.split())
    assert args.model_tag == "/models/x" and args.port == 9000 and args.api_key == "k"
    assert args.log_level == "info"
    engine = _engine_args(args)
    assert engine["tensor_parallel_size"] == 2 and engine["pipeline_parallel_size"] == 1
    assert engine["gpu_memory_utilization"] == 0.8 and engine["max_num_seqs"] == 8
    assert (engine["max_num_batched_tokens"], engine["block_size"]) == (512, 32)
    assert engine["enforce_eager"] and engine["trust_remote_code"]
    assert engine["enable_prefix_caching"] is False and engine["async_scheduling"]
    # vLLM's -O / --compilation-config: JSON fields, merged with --custom-pass.
    line = ["generate", "-O", '{"cudagraph_mode": "PIECEWISE", "custom_passes": ["a:b"]}',
            "--custom-pass", "c:d", "x"]  # fmt: skip
    engine = _engine_args(build_parser().parse_args(line))
    assert engine["compilation_config"] == {"cudagraph_mode": "PIECEWISE",
                                            "custom_passes": ["a:b", "c:d"]}  # fmt: skip
    res = _cli("generate", "--model", "/models/x", "-O", "{not json", "x")
    assert res.returncode == 2 and "not JSON" in res.stderr
    res = _cli("serve", "/models/a", "--model", "/models/b")
    assert res.returncode == 2 and "two models given" in res.stderr
    res = _cli("serve", "--chat-template", "/no/such/template.jinja")
    assert res.returncode == 2 and "no such file, and not a template" in res.stderr


def test_chat_keeps_the_conversation(tiny_llama):
    res = _cli(
        "chat", "--model", str(tiny_llama[0]), "--eager", "--max-tokens", "3", stdin="hi\nagain\n"
    )
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.strip().splitlines()) >= 1


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """`runtime.cli.main` in this process (what `python -m runtime.cli` runs, less the
    ~5 s a fresh interpreter takes to import torch): exit code, stdout, stderr."""
    from runtime.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_arguments_give_a_clear_error(tiny_llama, capsys):
    code, _, err = _main(capsys, "generate", "--model", str(tiny_llama[0]), "--top-p", "2", "x")
    assert code == 2 and "top_p must be in (0, 1]" in err
    code, _, err = _main(capsys, "generate", "--model", "/no/such/folder", "x")
    assert code == 2 and "/no/such/folder" in err
    bad_mode = ("-O", '{"cudagraph_mode": "x"}')
    code, _, err = _main(capsys, "generate", "--model", str(tiny_llama[0]), *bad_mode, "x")
    assert code == 2 and "cudagraph_mode must be one of" in err
    res = _cli("generate", "--model", "/no/such/folder", "x")  # and from a real process
    assert res.returncode == 2 and "/no/such/folder" in res.stderr


def test_help_explains_the_commands(capsys):
    code, out, _ = _main(capsys, "--help")
    assert code == 0 and "generate" in out and "chat" in out
    code, out, _ = _main(capsys, "generate", "--help")
    assert code == 0 and "--temperature" in out and "SmolLM2" in out


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
