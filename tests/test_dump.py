"""Dumps of the compiler's work and `compilecore diff`, as a user runs them (CLI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from compilecore.dump_diff import NotADumpError, diff_dumps
from tests.helpers import llama_config, save_checkpoint

pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, timeout=600
    )


LAYERS = 4  # enough for identical middle layers that compile once and group in diffs


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory, tokenizer_dir):
    path = tmp_path_factory.mktemp("four_layers")
    # The default model's widths (SmolLM2-135M: 576 hidden, 9 heads over 3 KV heads, 1536
    # MLP), with fewer layers and a small vocabulary.
    config = llama_config(
        num_hidden_layers=LAYERS, hidden_size=576, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3,
    )  # fmt: skip
    save_checkpoint(path, config, tokenizer_dir=tokenizer_dir)
    return path


@pytest.fixture(scope="module")
def dumps(four_layers, tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    # "on": two of our passes and a user's pass from the CLI, verified (one cold dump fewer
    # than one run each: ~20 s of the suite).
    runs = {
        "off1": [],
        "off2": [],
        "on": ["--passes", "fuse_add_rms_norm", "qkv_rope",
               "--custom-pass", "examples.silu_mul_pass:silu_mul_pass", "--verify"],
    }  # fmt: skip
    # Side by side: a dump compiles cold (dumps bypass every compile cache), so the three
    # processes share nothing but the cores, and together they take about half as long.
    cli = [sys.executable, "-m", "runtime.cli", "dump", "--model", str(four_layers)]
    procs = {}
    for name, flags in runs.items():
        command = [*cli, "--out", str(root / name), "--prompt", "abc", *flags]
        procs[name] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    for proc in procs.values():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
    return {name: root / name for name in runs}


def test_dump_has_every_file(dumps):
    layers = LAYERS
    rank = dumps["on"] / "rank_0"
    folder = rank / "LlamaModel.model"
    for name in ("transformed_code.py", "dynamo_graph.py", "split_graph.py"):
        assert (folder / name).stat().st_size > 0, name
        assert max(len(line) for line in (folder / name).read_text().splitlines()) < 400, name
    assert "__compiled_fn" in (folder / "transformed_code.py").read_text()
    assert len(list((folder / "pieces").glob("piece_*.py"))) == 2 * layers + 1
    # first, middle, last: the symbolic-size code and batch-1 decode's, each readable
    inductor = sorted(p.stem for p in (folder / "inductor").glob("piece_*.py"))
    assert inductor == [f"piece_{i}{s}" for i in (0, 2, 2 * layers) for s in ("", "_size_1")]
    report = json.loads((rank / "report.json").read_text())["LlamaModel.model"]
    assert report["pass_matches"]["fuse_add_rms_norm"] == 2 * layers
    # qkv of layer 0; o, gate/up, down and the next qkv per middle piece; o, gate/up, down
    gemv = report["pass_matches_by_variant"]["size_1"]["gemv_to_reduction"]
    assert (
        gemv == 4 * layers
        and report["pass_matches_by_variant"]["general"].get("gemv_to_reduction", 0) == 0
    )
    md = (rank / "report.md").read_text()
    assert f"| gemv_to_reduction | 0 | {4 * layers} |" in md
    assert "piece_2 (shared)" in md  # the middle layers run one compile
    passes = folder / "passes" / "piece_2"
    assert not (passes / "noop_elimination.before.py").exists()  # matched nothing: no files
    assert "noop_elimination 0" in (passes / "order.txt").read_text()
    assert {"torch", "triton", "depyf"} <= set(report["versions"])
    assert "traced_sources" in report["cache_factors"]
    assert (rank / "report.md").read_text().startswith("# compilecore dump")
    before = (folder / "passes" / "piece_2" / "fuse_add_rms_norm.before.py").read_text()
    after = (folder / "passes" / "piece_2" / "fuse_add_rms_norm.after.py").read_text()
    assert "fused_add_rms_norm" not in before and "aten.rsqrt" in before
    assert "fused_add_rms_norm" in after and "aten.rsqrt" not in after
    # the batch-1 CPU graph's program: each call, the regions formed, where calls came from
    rank = dumps["off1"] / "rank_0"
    program = (rank / "cpu_graphs" / "size_1.txt").read_text().splitlines()
    assert sum("CPU attention (decode)" in line for line in program) == layers
    assert (
        sum(
            "<- compilecore::unified_attention_with_output (model.layers." in line
            for line in program
        )
        == 2 * layers
    )  # write and decode, layer by layer
    assert any("region 1 (team of" in line for line in program)
    assert "Inductor kernel" in program[1] and "(plain)" in program[1]
    data = json.loads((rank / "report.json").read_text())["cpu_graphs"]["size_1"]
    regions = data["regions"]
    assert data["stats"]["parallel_regions"] == sum(r["team"] > 0 for r in regions)
    assert sorted(c for r in regions for c in r["calls"]) == list(range(len(data["calls"])))
    assert "| size | calls | parallel regions" in (rank / "report.md").read_text()


def test_diff_reports_the_expected_op_deltas(dumps):
    layers = LAYERS
    diff = diff_dumps(dumps["off1"], dumps["on"])
    total = diff.total_deltas()
    assert total["compilecore.fused_add_rms_norm"] == 2 * layers
    assert total["compilecore.fused_qkv_rope"] == layers
    assert total["aten.rsqrt"] == -2 * layers  # layer 0's input norm stays unfused
    assert total["aten.split_with_sizes"] == -layers
    res = _cli("diff", str(dumps["off1"]), str(dumps["on"]), "--stat")
    assert res.returncode == 1
    assert f"+compilecore.fused_add_rms_norm {2 * layers}" in res.stdout
    # The passes' own rewrites come first; identical layers are one line.
    lines = res.stdout.splitlines()
    assert lines[0].startswith("pass "), lines[0]  # (torch 2.11: cleanup rewrites too)
    assert any(line.startswith("pass fuse_add_rms_norm (rewrote in B") for line in lines)
    assert f"piece_02..piece_{2 * layers - 2:02d} ({layers - 1} pieces)" in res.stdout
    assert "Inductor code files differ (--kernels shows them)" in res.stdout
    full = _cli("diff", str(dumps["off1"]), str(dumps["on"])).stdout
    passes_part = full.split("op deltas")[0]  # the unified diffs of the passes' graphs
    assert "+    " in passes_part and "compilecore.fused_add_rms_norm.default" in passes_part
    assert "inductor/" not in full  # kernels only with --kernels
    assert "inductor/" in _cli("diff", str(dumps["off1"]), str(dumps["on"]), "--kernels").stdout


def test_a_user_pass_from_the_cli_is_dumped_verified_and_diffed(dumps):
    report = json.loads((dumps["on"] / "rank_0" / "report.json").read_text())
    matches = report["LlamaModel.model"]["pass_matches_by_variant"]
    assert matches["general"]["fuse_silu_mul"] == LAYERS == matches["size_1"]["fuse_silu_mul"]
    diff = diff_dumps(dumps["off1"], dumps["on"])
    assert diff.total_deltas()["examples.silu_and_mul"] == LAYERS
    assert "fuse_silu_mul" in [c.name for c in diff.pass_changes]


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
