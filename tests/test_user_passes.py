"""User-written passes through the public API (`passes.GraphPass`, `passes.PatternPass`,
`compilation_config["custom_passes"]`), with the examples in examples/."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from compilecore import testing
from compilecore.config import CompilationConfig
from compilecore.counters import compilation_counter
from examples.silu_mul_pass import silu_mul_pass
from examples.wrong_square_pass import WrongSquarePass
from passes import FunctionPass, GraphPass, as_pass
from passes.verifier import PassVerificationError
from runtime import LLM, SamplingParams
from runtime.testing import compiled_eager_pair
from tests.helpers import llama_config

aten = torch.ops.aten


def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # the merged gate/up projection, then SiluAndMul
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_pass_fuses_each_site(dtype):
    x, w = torch.randn(6, 16, dtype=dtype), torch.randn(16, 32, dtype=dtype)
    backend = testing.check_pass(silu_mul_pass(), mlp, x, w)
    assert backend.matches("fuse_silu_mul") == 1
    assert testing.count_ops(backend.graph_before, aten.exp) == 1
    assert testing.count_ops(backend.graph_after, aten.exp) == 0
    assert backend.ops_after()["examples.silu_and_mul"] == 1


def test_wrong_pass_is_rejected_by_the_verifier_naming_it():
    x, w = torch.randn(5, 16), torch.randn(16)
    with pytest.raises(Exception, match="pass wrong_square on .*: output 0") as info:
        testing.check_pass(WrongSquarePass(), rms_norm, x, w)
    assert isinstance(info.value, PassVerificationError) or "PassVerificationError" in repr(
        info.value
    )


def count_adds(graph: fx.Graph) -> int:
    """A function pass: finds sites, rewrites none."""
    return 0


def test_pass_specs_and_their_errors():
    assert as_pass(count_adds).name == "count_adds"
    assert as_pass("examples.silu_mul_pass:silu_mul_pass").name == "fuse_silu_mul"  # factory
    assert as_pass("examples.wrong_square_pass:WrongSquarePass").name == "wrong_square"
    with pytest.raises(ValueError, match="module:attribute"):
        as_pass("examples.silu_mul_pass")
    with pytest.raises(ValueError, match="cannot be loaded"):
        as_pass("examples.no_such_module:thing")
    with pytest.raises(TypeError, match="is not a pass"):
        as_pass(42)
    with pytest.raises(ValueError, match="already taken"):
        CompilationConfig(custom_passes=[count_adds, count_adds])
    with pytest.raises(ValueError, match="already taken"):
        CompilationConfig(custom_passes=[as_pass(count_adds), FunctionPass(count_adds, "cleanup")])
    with pytest.raises(ValueError, match="has no name"):
        CompilationConfig(custom_passes=[GraphPass()])


class TaggedPass(GraphPass):
    """Matches nothing; its configuration is its tag, so the uuid follows the tag."""

    name = "tagged"

    def __init__(self, tag: str):
        self.tag = tag

    def config(self) -> dict:
        return {"tag": self.tag}

    def __call__(self, graph: fx.Graph) -> int:
        return 0


@pytest.mark.slow
def test_a_changed_pass_uuid_invalidates_the_cache(tmp_path):
    config = llama_config(num_hidden_layers=1)
    ids, positions = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)

    def run(tag: str) -> None:
        compiled, eager = compiled_eager_pair(
            config, cache_dir=str(tmp_path), custom_passes=[TaggedPass(tag)]
        )
        testing.assert_compiled_matches_eager(compiled, eager, ids, positions)

    assert TaggedPass("a").uuid() != TaggedPass("b").uuid()
    run("a")
    with compilation_counter.expect(num_warm_starts=1, num_inductor_compiles=0):
        run("a")  # same pass, same uuid: the recipe and the artifacts are reused
    before = compilation_counter.num_inductor_compiles
    with compilation_counter.expect(num_warm_starts=0, num_graphs_seen=1):
        run("b")
    assert compilation_counter.num_inductor_compiles > before


@pytest.mark.slow
def test_user_pass_through_llm_keeps_greedy_tokens(tiny_llama, tmp_path):
    layers = tiny_llama[1].config.num_hidden_layers
    cc = {
        "custom_passes": [silu_mul_pass()],
        "passes": {"verify": True},
        "debug_dump_path": str(tmp_path / "dump"),
    }
    llm = LLM(str(tiny_llama[0]), compilation_config=cc)
    eager = LLM(str(tiny_llama[0]), enforce_eager=True)
    prompts = [[5, 6, 7, 8, 9], [42, 17]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
    rank = tmp_path / "dump" / "rank_0"
    report = json.loads((rank / "report.json").read_text())["LlamaModel.model"]
    for variant in ("general", "size_1"):  # the symbolic-size code and batch-1 decode's
        assert report["pass_matches_by_variant"][variant]["fuse_silu_mul"] == layers
    ops = [p["ops"].get("examples.silu_and_mul", 0) for p in report["pieces"]]
    assert sum(ops) == layers
    # The MLP follows the first attention: piece 2 (and its batch-1 code).
    before = rank / "LlamaModel.model" / "passes" / "piece_2" / "fuse_silu_mul.before.py"
    assert "aten.exp" in before.read_text()
    assert "examples.silu_and_mul" in before.with_name("fuse_silu_mul.after.py").read_text()
