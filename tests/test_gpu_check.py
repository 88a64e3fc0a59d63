"""The device check script runs its steps on CPU (`--dry-run`) in CI, so it cannot rot
between the rare runs on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
def test_dry_run_passes_every_step(tmp_path):
    res = _run(str(tmp_path), "--dry-run")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {r["step"]: r for r in report["steps"]}
    assert list(steps) == [
        "greedy_cpu_vs_device", "default_model_bf16", "temperature_sampling",
        "graphs_vs_eager", "chunked_prefill", "split_kv", "decode_bandwidth", "batch_curve",
        "prefill_and_long_context",
        "attention_trips", "splitk_gemv", "quantized_products", "quantized_decode",
        "passes_on_off", "batch_invariant", "tensor_parallel",
        "gpu_tests",
    ]  # fmt: skip
    assert steps["batch_invariant"]["detail"]["differ"] == []
    assert steps["batch_invariant"]["detail"]["invariant_tok_s"] > 0
    assert all(r["status"] == "ok" for r in steps.values())
    assert "skipped" in steps["gpu_tests"]["detail"]["summary"]  # collected, no device
    assert steps["graphs_vs_eager"]["detail"]["ratio"] > 0
    # 4 runs x 63 decode steps, every one a replay but the step that recorded the graph
    assert steps["graphs_vs_eager"]["detail"]["replays"] == 4 * 63 - 1
    assert steps["chunked_prefill"]["detail"]["replays"] > 0
    assert steps["default_model_bf16"]["detail"]["tokens_compared"] > 0
    decode = steps["decode_bandwidth"]["detail"]
    assert decode["default"]["of_read"] > 0 and decode["async"]["tok_s"] > 0
    assert decode["default"]["of_peak"] is None  # no nominal peak for a CPU
    ms = steps["decode_bandwidth"]["detail"]["default"]["ms_per_step"]
    assert ms["step"] >= ms["model_call"] > 0 and ms["sampler"] > 0  # where a step's time goes
    assert abs(ms["step"] - ms["model_call"] - ms["sampler"] - ms["other"]) < 0.01
    curve = steps["batch_curve"]["detail"]["batches"]
    assert sorted(curve) == ["greedy x1", "greedy x4", "sampled x1", "sampled x4"]
    assert all(r["tok_s"] > 0 and r["GB_s"] > 0 for r in curve.values())
    assert curve["greedy x4"]["tokens"] == 4 * 15  # 16 tokens each, the first not decoded
    long = steps["prefill_and_long_context"]["detail"]
    assert long["prefill_tok_s"] > 0 and long["long_tok_s"] > 0 and long["long_GB_s"] > 0
    assert long["prefill_mfu"] is None  # no nominal FLOPs for a CPU
    assert "| passes_on_off | ok |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device exit")
def test_without_a_device_it_says_so(tmp_path):
    res = _run(str(tmp_path))
    assert res.returncode == 2 and "no CUDA device" in res.stderr


def test_the_device_runs_only_the_gpu_marked_test_files():
    """On a device the GPU-test step collects the files with GPU-marked tests, not the
    whole suite (its minutes are few)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    files = gpu_check.gpu_test_files()
    assert "tests/test_cuda_graphs.py" in files and "tests/test_sampling.py" not in files
    assert all("mark.gpu" in (SCRIPT.parent.parent / f).read_text() for f in files)


def test_the_decode_figure_divides_by_the_parts_nominal_peak():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    assert gpu_check.nominal_bandwidth("NVIDIA H100 80GB HBM3") == ("H100 SXM", 3.35)
    assert gpu_check.nominal_bandwidth("NVIDIA H100 PCIe") == ("H100 PCIe", 2.0)
    assert gpu_check.nominal_bandwidth("NVIDIA H200") == ("H200", 4.8)
    assert gpu_check.nominal_bandwidth("NVIDIA GH200 480GB") == ("GH200 (HBM3)", 4.0)
    assert gpu_check.nominal_bandwidth("NVIDIA A100-SXM4-80GB")[1] == 2.039
    assert gpu_check.nominal_bandwidth("Some Future GPU") is None
