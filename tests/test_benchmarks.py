"""The benchmark scripts run on a tiny model (a smoke run) and write well-formed results.
No timing is asserted: speed is measured by running them, not by tests."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
BENCH = Path(__file__).parent.parent / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _check(path: Path, engines: int) -> dict:
    data = json.loads(path.read_text())
    assert data["title"] and data["machine"]["torch"]
    assert data["machine"]["weight_prefetch_bytes"] in (0, 4096)
    assert len(data["rows"]) == engines
    assert path.with_suffix(".md").read_text().startswith("### ")
    return data


def _args(tiny_llama, tmp_path, *extra: str) -> list[str]:
    return [
        "--model",
        str(tiny_llama[0]),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--out",
        str(tmp_path),
        *extra,
    ]


@pytest.mark.parametrize("draw", [[], ["--sampled"]], ids=["greedy", "sampled"])
def test_latency_smoke(tiny_llama, tmp_path, draw):
    quick = ["--tokens", "4", "--repeats", "1", "--rounds", "1", "--ceiling-mb", "64"]
    out = _load("bench_latency").main(_args(tiny_llama, tmp_path, *quick, *draw))
    assert out.name == ("latency_sampled.json" if draw else "latency.json")
    data = _check(out, 4)
    assert ("sampled (temperature 0.8, top_p 0.95)" in data["title"]) == bool(draw)
    rows = {r["engine"]: r for r in data["rows"]}
    memory = "memory (a sum over the weights' bytes per token)"
    assert set(rows) == {"compilecore eager", "compilecore compiled", memory, "HF eager"}
    assert all(r["tok_s"] > 0 and r["GB_s"] > 0 for r in rows.values())
    weights = rows[memory]["MB_read"]  # fp32: no screened head, every engine reads it all
    assert all(r["MB_read"] == weights for r in rows.values())
    for r in rows.values():  # the bandwidth share and the speed share agree at equal bytes
        assert r["of_ceiling"] == pytest.approx(r["of_floor_speed"])
    # the compiled engine and the memory's own decode ran in the paired rounds
    assert rows["compilecore compiled"]["of_paired_bw"] > 0 and rows[memory]["of_paired_bw"] > 0
    assert "of_paired_bw" not in rows["compilecore eager"]


def test_paired_bandwidth_compares_a_run_with_sums_just_around_it():
    common = _load("common")
    paired = common.PairedBandwidth(nbytes=16 << 20)
    assert paired.measure(seconds=0.0) > 0  # real sums over written memory
    calls, shares = [], []
    speed = paired.around(lambda: calls.append(1) or 2.5, bytes_per_unit=4e9, shares=shares)
    assert (speed, calls) == (2.5, [1]) and len(shares) == 1 and shares[0] > 0

    class Scripted(common.PairedBandwidth):  # the arithmetic, with known sums
        def measure(self, seconds: float = 0.1) -> float:
            return self.sums.pop(0)

    scripted = Scripted(nbytes=1 << 20)
    scripted.sums = [10.0, 30.0]  # GB/s before and after the run
    shares = []
    assert scripted.around(lambda: 2.5, bytes_per_unit=4e9, shares=shares) == 2.5
    assert shares == [0.5]  # 10 GB/s of 20


def test_every_read_of_the_ceiling_sums_the_whole_buffer():
    """The ceiling takes the fastest of torch's sum and a native loop without and with a
    software prefetch (`common.sums`): each must read every byte (a read that skipped
    some would be a false ceiling), up to its last float past the last 64."""
    common = _load("common")
    x = common._sum_buffer((8 << 20) + 4 * 37, torch.float32, "cpu", True)
    x[::997] = 3.0
    x[-1] = 5.0
    want = float(x.double().sum())
    reads = common.sums(x)
    assert len(reads) == (3 if common._memory_read() is not None else 1)
    for read in reads:
        assert float(read()) == pytest.approx(want, rel=1e-5)
    assert float(common.fastest_sum(x)()) == pytest.approx(want, rel=1e-5)
    assert common.read_bandwidth(nbytes=4 << 20, repeats=1) > 0


def test_throughput_smoke_through_the_cli(tiny_llama, tmp_path):
    # Sampled: the greedy offline run differs only in its SamplingParams (and HF's flags).
    extra = ["--requests", "4", "--min-len", "3", "--max-len", "6", "--hf-batch", "2", "--sampled"]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime.cli",
            "bench",
            "throughput",
            *_args(tiny_llama, tmp_path, *extra),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = _check(tmp_path / "throughput_sampled.json", 2)
    assert "sampled (temperature 0.8, top_p 0.95)" in data["title"]
    assert all(r["tok_s"] > 0 and "vs_HF" in r for r in data["rows"])


def test_startup_smoke(tiny_llama, tmp_path):
    out = _load("bench_startup").main(_args(tiny_llama, tmp_path))
    cold, warm = _check(out, 2)["rows"]
    assert cold["inductor_compiles"] > 0 and cold["cache_hits"] == 0
    assert warm["inductor_compiles"] == 0 and warm["cache_hits"] > 0


@pytest.mark.parametrize("draw", [[], ["--sampled"]], ids=["greedy", "sampled"])
def test_host_smoke(tiny_llama, tmp_path, draw):
    out = _load("bench_host").main(
        _args(tiny_llama, tmp_path, "--steps", "6", "--rounds", "2", *draw)
    )
    assert out.name == ("host_sampled.json" if draw else "host.json")
    rows = _check(out, 2)["rows"]
    assert all(r["steps"] == 6 and r["replays"] == 6 for r in rows)  # every step replayed
    assert all(0 < r["replay_ms"] < r["step_ms"] and r["host_ms"] > 0 for r in rows)


def test_serve_smoke_reports_missing_peers(tiny_llama, tmp_path, capsys):
    extra = ["--concurrency", "1,2", "--requests-per-client", "1", "--min-words", "2",
             "--max-words", "4", "--min-out", "2", "--max-out", "3"]  # fmt: skip
    out = _load("bench_serve").main(_args(tiny_llama, tmp_path, *extra))
    rows = _check(out, 2)["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert all(r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0 for r in rows)
    assert "not measured, missing" in capsys.readouterr().out  # no GGUF for a tiny model


@pytest.mark.slow
def test_spec_smoke(tiny_llama, capsys):
    """bench_spec.py's rounds on a tiny model: every workload's plain and n-gram rows, the
    tokens compared with plain decoding's (an fp32 model: equal); no llama-lookup rows for a
    model that is not a GGUF file."""
    _load("bench_spec").main(["--model", str(tiny_llama[0]), "--rounds", "1", "--tokens", "8",
                              "--k", "2"])  # fmt: skip
    out = capsys.readouterr().out
    for label in ("code", "grounded", "free"):
        assert re.search(rf"^{label}\s+plain\s+[\d.]+ tok/s", out, re.M), out
        assert re.search(rf"^{label}\s+ngram k=2 .* tokens equal: True", out, re.M), out
    assert "llama-lookup" not in out


def test_aot_compile_compare_smoke():
    # The host row only: at this size the warm-start row would compile the same model again.
    # The three variants side by side: a smoke run checks the rows, not their timings.
    rows = _load("aot_compile_compare").main(["--models", "host", "--calls", "3", "--jobs", "3"])
    assert [(r["variant"], r["model"]) for r in rows] == [
        (v, "host") for v in ("recipe", "recipe-whole", "aot")
    ]
    missing = _load("aot_compile_compare").aot_missing()
    assert ("skipped" in rows[2]) == (missing is not None)  # torch 2.11 lacks the API
    for r in rows[: 2 if missing else 3]:
        for phase in ("cold", "warm"):
            assert "error" not in r[phase], r
            assert r[phase]["first_call_s"] > 0 and r[phase]["call_us"] > 0


def test_bytes_read_per_token_counts_a_quantized_heads_blocks(tmp_path, tiny_llama):
    """A GGUF whose head stays quantized (Q8_0) has no 16-bit weight to screen: a greedy
    step reads every weight, its blocks included (this raised before, so bench_latency
    could not run on such a file)."""
    from runtime import LLM, SamplingParams
    from tests.gguf_files import Q, write_gguf

    common = _load("common")
    path = tmp_path / "q8_head.gguf"
    write_gguf(path, tiny_llama[1], {"lm_head": Q.Q8_0}, Q.Q4_1)
    llm = LLM(str(path), tokenizer=str(tiny_llama[0]), enforce_eager=True, max_model_len=128)
    assert not hasattr(llm.llm_engine.model.lm_head, "weight")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert common.bytes_read_per_token(llm, None) == common.weight_bytes(llm)
    assert common.bytes_read_per_token(llm, {"temperature": 1.0}) == common.weight_bytes(llm)
    # The untied embedding: one row a step, not the table.
    model = llm.llm_engine.model
    table = list(model.model.embed_tokens.parameters())
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in table)
    assert common.weight_bytes(llm) == everything - nbytes + nbytes // table[0].shape[0]


def test_ab_quant_kernels_smoke(tiny_gguf, tokenizer_dir, capsys):
    """Two builds of the quantized kernels (here the committed one and the working
    tree's), one engine each on a GGUF file, alternating rounds; the process's own build is
    back afterwards."""
    from passes.ops import quantized

    if subprocess.run(["git", "-C", str(BENCH), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout: no committed build to compare with")
    before = quantized._kernel
    ab = _load("ab_quant_kernels")
    ratio = ab.main([str(tiny_gguf[0]), "--base", "HEAD", "--rounds", "2", "--tokens", "4",
                     "--max-model-len", "128", "--tokenizer", str(tokenizer_dir)])  # fmt: skip
    assert ratio > 0 and "tree / HEAD" in capsys.readouterr().out
    assert quantized._kernel is before


def test_ab_quant_raw_smoke(capsys):
    """Two builds' products on small random blocks: a ratio per row count, and each
    build's error against fp64 printed (the working tree's within fp32 sums)."""
    if subprocess.run(["git", "-C", str(BENCH), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout: no committed build to compare with")
    ab = _load("ab_quant_raw")
    ratios = ab.main(["--base", "HEAD", "--format", "q4", "--shapes", "48x128", "--rows",
                      "1,9", "--rounds", "2", "--ms", "1"])  # fmt: skip
    assert set(ratios) == {1, 9} and all(r > 0 for r in ratios.values())
    out = capsys.readouterr().out
    assert out.count("largest error") == 2
    assert all(float(line.rsplit("tree ", 1)[1]) < 1e-4 for line in out.splitlines()
               if "largest error" in line)  # fmt: skip


def test_bench_quantize_at_load_smoke(tiny_llama, capsys):
    """bf16 and int8 engines of one float checkpoint, one round: a ratio each (bf16's 1)."""
    bench = _load("bench_quantize_at_load")
    ratios = bench.main(["--model", str(tiny_llama[0]), "--formats", "int8", "--rounds", "1",
                         "--tokens", "4"])  # fmt: skip
    assert ratios["bf16"] == 1.0 and ratios["int8"] > 0
    assert "int8:" in capsys.readouterr().out


def test_ab_cpu_graph_sizes_smoke(tiny_llama, capsys):
    """Batches of 24: a graph at 24 against piece by piece, one round; same tokens."""
    bench = _load("ab_cpu_graph_sizes")
    ratio = bench.main(["--model", str(tiny_llama[0]), "--batch", "24", "--rounds", "1",
                        "--tokens", "6"])  # fmt: skip
    assert ratio > 0
    assert "same tokens 24/24" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_ab_compact_scales_smoke(capsys, fmt):
    """Compact against fp32 K-quant scales, small shapes, two rounds: identical outputs."""
    bench = _load("ab_compact_scales")
    assert bench.main(["--format", fmt, "--layers", "1", "--rounds", "2", "--scale", "8"]) > 0
    assert "outputs identical" in capsys.readouterr().out
