"""Every Triton kernel specialization the CPU tests launch in the interpreter, compiled
for Hopper (sm_90) by Triton's own compiler, which needs no GPU: a kernel the interpreter
runs but the compiler refuses (a constexpr reassigned, a type that differs between an
if's branches, an op the interpreter allows) fails here instead of in the first minute
of a rare device session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# (test files, -k expression): the tests that launch the kernels, cheaply.
RUNS = [
    (["tests/test_triton_attention.py", "tests/test_fused_kernels.py",
      "tests/test_splitk_gemv.py"], None),
    (["tests/test_quantized.py", "tests/test_batch_invariant.py",
      "tests/test_sample_kernel.py"],
     "triton or plainly or greedy_rows or tied or seeded"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records the interpreter")
def test_every_kernel_the_interpreter_ran_compiles_for_hopper(tmp_path):
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("Triton has no NVIDIA backend here")
    record = tmp_path / "specializations.json"
    env = {**os.environ, "COMPILECORE_TRITON_RECORD": str(record)}
    for files, select in RUNS:
        args = [sys.executable, "-m", "pytest", "-q", "-p", "tests.triton_record",
                "-p", "no:cacheprovider", "-n", "0", *files]  # fmt: skip
        done = subprocess.run(args + (["-k", select] if select else []), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:]
    names = {spec["name"] for spec in __import__("json").loads(record.read_text())}
    assert {"attention_kernel", "quant_stream_kernel", "_sample_kernel"} <= names, names
    env.pop("TRITON_INTERPRET")
    done = subprocess.run([sys.executable, "-m", "tests.triton_compile", str(record), "90"],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
