"""The on-disk compile cache across processes: a warm start compiles nothing, and a
corrupt entry is reported, recompiled and replaced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
CHILD = Path(__file__).with_name("warm_start_child.py")


def _run(model_dir, cache_dir) -> dict:
    res = subprocess.run(
        [sys.executable, str(CHILD), str(model_dir), str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_warm_start_and_corrupt_entry(tiny_llama, tmp_path):
    cold = _run(tiny_llama[0], tmp_path)
    assert cold["counters"]["num_inductor_compiles"] > 0
    assert cold["counters"]["num_cache_hits"] == 0
    distinct = cold["counters"]["num_inductor_compiles"]

    warm = _run(tiny_llama[0], tmp_path)
    assert warm["counters"]["num_inductor_compiles"] == 0
    assert warm["counters"]["num_cache_hits"] == distinct
    # The forward recipe: no Dynamo trace at all in the warm process.
    assert warm["counters"]["num_graphs_seen"] == 0
    assert warm["counters"]["num_warm_starts"] == 1
    assert warm["tokens"] == cold["tokens"]
    ratio = cold["time_to_first_token_s"] / warm["time_to_first_token_s"]
    print(
        f"\ntime to first token from process start: cold {cold['time_to_first_token_s']:.2f} s, "
        f"warm {warm['time_to_first_token_s']:.2f} s ({ratio:.1f}x faster)"
    )

    entries = sorted(tmp_path.rglob("piece_*.bin"))
    assert len(entries) == distinct
    entries[0].write_bytes(entries[0].read_bytes()[:64])  # truncated: unreadable
    recovered = _run(tiny_llama[0], tmp_path)
    assert recovered["counters"]["num_cache_errors"] == 1
    assert recovered["counters"]["num_inductor_compiles"] == 1
    assert recovered["counters"]["num_graphs_seen"] == 1  # the recipe fell back to tracing
    assert recovered["tokens"] == cold["tokens"]
    again = _run(tiny_llama[0], tmp_path)  # the entry was replaced
    assert again["counters"]["num_cache_hits"] == distinct
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporaries
