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
    assert "Exception ignored" not in res.stderr  # nothing left for the teardown to trip on
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
    assert sorted(tmp_path.rglob("piece_*.bin")) == entries  # the entry was written again
    from torch._inductor import CompiledArtifact

    CompiledArtifact.load(path=str(entries[0]), format="binary")  # whole: it loads
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporaries


def test_pass_report_survives_an_inductor_cache_hit(tiny_llama, tmp_path, monkeypatch):
    """A compile that Inductor's FX graph cache answers (here: the same model under a new
    compilecore cache dir) runs no passes; the report saved by the compile that ran them
    stands in, so the stats (and dumps) still say what the passes did."""
    import shutil

    from torch._dynamo.utils import counters

    from runtime import LLM

    inductor = tmp_path / "inductor"  # a cold Inductor cache of this test's own
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))

    def matches(name: str) -> dict:
        cc = {"cache_dir": str(tmp_path / name)}
        llm = LLM(str(tiny_llama[0]), max_model_len=64, compilation_config=cc)
        backend = llm.llm_engine.runner.model.model._compiled_forward.backend
        return backend.stats.pass_matches_by_variant

    hits = counters["inductor"]["fxgraph_cache_hit"]
    first = matches("a")
    assert counters["inductor"]["fxgraph_cache_hit"] == hits  # the passes ran
    assert first["size_1"]["gemv_to_reduction"] > 0
    second = matches("b")
    assert counters["inductor"]["fxgraph_cache_hit"] > hits  # Inductor answered...
    assert second == first  # ...and the saved report stood in for the passes
    shutil.rmtree(inductor / "compilecore_pass_reports")
    third = matches("c")  # without the report nothing is known, and nothing is made up
    assert not any(third.values())


# -- the cache folder is code: who may write it, and what if nobody can ----------------
def _greedy(path, cache_dir) -> list[int]:
    from runtime import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=64, compilation_config={"cache_dir": str(cache_dir)})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids


def test_world_writable_cache_is_refused(tiny_llama, tmp_path):
    from compilecore.compile_cache import CacheDirError

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(CacheDirError, match="writable by every user.*chmod o-w"):
        _greedy(tiny_llama[0], shared)
    with pytest.raises(CacheDirError, match="writable by every user"):
        _greedy(tiny_llama[0], shared / "not" / "yet" / "made")  # inside it: the same


def test_unwritable_cache_warns_and_runs_uncached(tiny_llama, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would have to live inside a file
    with caplog.at_level("WARNING", logger="compilecore"):
        tokens = _greedy(tiny_llama[0], blocker / "cache")
    assert "running uncached" in caplog.text
    assert tokens == _greedy(tiny_llama[0], tmp_path / "good")


def test_damaged_recipe_falls_back_to_tracing(tiny_llama, tmp_path):
    from compilecore.counters import compilation_counter

    want = _greedy(tiny_llama[0], tmp_path)
    for recipe in tmp_path.rglob("recipes/**/*.json"):
        data = json.loads(recipe.read_text())
        for piece in data["pieces"]:
            piece.pop("artifact", None)
            piece.pop("code", None)  # parses, but names nothing to run
        recipe.write_text(json.dumps(data))
    before = compilation_counter.num_graphs_seen
    assert _greedy(tiny_llama[0], tmp_path) == want
    assert compilation_counter.num_graphs_seen == before + 1  # traced again


def test_files_in_other_block_formats_do_not_share_artifacts(tokenizer_dir, tmp_path):
    """Two GGUF files of one model, Q8_0 layers in one and Q6_K layers in the other: both
    trace as `dequantize_q8` to the same graph code, over fields of other shapes. The
    cache tells them apart by the graph's inputs, so the second file's start compiles its
    own code (it loaded the first file's, whose shape checks failed) and gives the tokens
    it gives with a cache of its own."""
    from runtime import LLM, SamplingParams
    from tests.gguf_files import Q, write_gguf
    from tests.helpers import llama_config, save_checkpoint

    config = llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2)  # fmt: skip
    hf = save_checkpoint(tmp_path / "hf", config)
    files = {q: tmp_path / f"{q.name}.gguf" for q in (Q.Q8_0, Q.Q6_K)}
    for q, path in files.items():
        write_gguf(path, hf, {}, q)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def tokens(path: Path, cache: Path) -> list[list[int]]:
        llm = LLM(str(path), tokenizer=str(tokenizer_dir), max_model_len=64,
                  compilation_config={"cache_dir": str(cache)})  # fmt: skip
        outs = llm.generate([[5, 17, 33], [9]], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    tokens(files[Q.Q8_0], tmp_path / "shared")
    assert tokens(files[Q.Q6_K], tmp_path / "shared") == tokens(files[Q.Q6_K], tmp_path / "own")
