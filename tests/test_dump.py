"""Dumps of the compiler's work and `compilecore diff`, as a user runs them (CLI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from compilecore.dump_diff import NotADumpError, diff_dumps

pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def dumps(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    made = {}
    for name, passes in (("off1", []), ("off2", []), ("on", ["fuse_add_rms_norm", "qkv_rope"])):
        res = _cli(
            "dump",
            "--model",
            str(tiny_llama[0]),
            "--out",
            str(root / name),
            "--prompt",
            "abc",
            *(["--passes", *passes] if passes else []),
        )
        assert res.returncode == 0, res.stderr[-3000:]
        made[name] = root / name
    return made


def test_dump_has_every_file(dumps, tiny_llama):
    layers = tiny_llama[1].config.num_hidden_layers
    rank = dumps["on"] / "rank_0"
    folder = rank / "LlamaModel.model"
    for name in ("transformed_code.py", "dynamo_graph.py", "split_graph.py"):
        assert (folder / name).stat().st_size > 0, name
    assert "__compiled_fn" in (folder / "transformed_code.py").read_text()
    assert len(list((folder / "pieces").glob("piece_*.py"))) == 2 * layers + 1
    assert len(list((folder / "inductor").glob("piece_*.py"))) == 3  # first, middle, last
    report = json.loads((rank / "report.json").read_text())["LlamaModel.model"]
    assert report["pass_matches"]["fuse_add_rms_norm"] == 2 * layers
    assert {"torch", "triton", "depyf"} <= set(report["versions"])
    assert "traced_sources" in report["cache_factors"]
    assert (rank / "report.md").read_text().startswith("# compilecore dump")
    before = (folder / "passes" / "piece_2" / "fuse_add_rms_norm.before.py").read_text()
    after = (folder / "passes" / "piece_2" / "fuse_add_rms_norm.after.py").read_text()
    assert "fused_add_rms_norm" not in before and "aten.rsqrt" in before
    assert "fused_add_rms_norm" in after and "aten.rsqrt" not in after


def test_diff_reports_the_expected_op_deltas(dumps, tiny_llama):
    layers = tiny_llama[1].config.num_hidden_layers
    diff = diff_dumps(dumps["off1"], dumps["on"])
    total = diff.total_deltas()
    assert total["compilecore.fused_add_rms_norm"] == 2 * layers
    assert total["compilecore.fused_qkv_rope"] == layers
    assert total["aten.rsqrt"] == -2 * layers  # layer 0's input norm stays unfused
    assert total["aten.split_with_sizes"] == -layers
    res = _cli("diff", str(dumps["off1"]), str(dumps["on"]), "--stat")
    assert res.returncode == 1
    assert f"+compilecore.fused_add_rms_norm {2 * layers}" in res.stdout


def test_dumps_from_two_processes_diff_equal(dumps):
    res = _cli("diff", str(dumps["off1"]), str(dumps["off2"]))
    assert res.returncode == 0, res.stdout[-3000:]
    assert res.stdout.strip() == "dumps are equal"
    assert diff_dumps(dumps["on"], dumps["on"]).equal


def test_a_folder_that_is_not_a_dump(tmp_path):
    with pytest.raises(NotADumpError, match="not a compilecore dump"):
        diff_dumps(tmp_path, tmp_path)
    res = _cli("diff", str(tmp_path), str(tmp_path))
    assert res.returncode == 2 and "not a compilecore dump" in res.stderr
