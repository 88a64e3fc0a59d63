"""The compile pipeline: one trace, the split at attention, per-piece Inductor compiles
(identical pieces once), no recompiles, compiled == eager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from compilecore import testing
from compilecore.compile_cache import file_digest
from compilecore.config import CompilationConfig, EngineConfig
from compilecore.counters import compilation_counter
from compilecore.decorators import support_torch_compile
from compilecore.forward_context import set_forward_context
from compilecore.recipe import ForwardRecipe, RecipeRunner
from runtime import LLM, SamplingParams
from runtime.attention import AttentionMetadata
from tests.helpers import load_ours, save_checkpoint

ATTENTION_CALLS = [0]


@torch.library.custom_op("compilecore_test::silly_attention", mutates_args=("out",))
def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    ATTENTION_CALLS[0] += 1
    out.copy_(q * 0.25 + k - v)


@silly_attention.register_fake
def _(q, k, v, out) -> None:
    return None


@support_torch_compile
class SillyModel(nn.Module):
    """L 'attention' layers around a counting custom op."""

    def __init__(self, *, engine_config: EngineConfig, prefix: str = "", num_layers: int = 4):
        super().__init__()
        self.prefix = prefix
        self.num_layers = num_layers
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.weight + 1.0
        for _ in range(self.num_layers):
            out = torch.empty_like(x)
            torch.ops.compilecore_test.silly_attention(x, x * 2.0, x.relu(), out)
            x = torch.tanh(out @ self.weight) + 0.5
        return x.sum(-1, keepdim=True) - 1.0


def _silly_config(tmp_path, **compilation) -> EngineConfig:
    compilation.setdefault("compile_sizes", [])  # only the symbolic-size code, unless asked
    cc = CompilationConfig(
        splitting_ops=["compilecore_test::silly_attention"], cache_dir=str(tmp_path), **compilation
    )
    hf = SimpleNamespace(name="silly", max_position_embeddings=1024)
    return EngineConfig.for_hf_config(hf, compilation_config=cc)


@pytest.mark.parametrize("num_layers", [1, 4])
def test_silly_model_pieces_and_counts(tmp_path, num_layers):
    torch.manual_seed(0)
    compiled = SillyModel(engine_config=_silly_config(tmp_path), num_layers=num_layers)
    eager = SillyModel(engine_config=_silly_config(tmp_path, mode="none"), num_layers=num_layers)
    eager.load_state_dict(compiled.state_dict())
    distinct = 2 if num_layers == 1 else 3  # first, middle (shared), last
    x = torch.randn(5, 8)
    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * num_layers + 1,
        num_piecewise_capturable_graphs_seen=num_layers + 1,
        num_backend_compilations=distinct,
        num_inductor_compiles=distinct,
        num_recompiles=0,
    ):
        got = compiled(x)
    for n in (1, 3, 17):  # attention really runs eagerly between pieces, every call
        x = torch.randn(n, 8)
        before = ATTENTION_CALLS[0]
        got = compiled(x)
        assert ATTENTION_CALLS[0] - before == num_layers
        assert torch.allclose(got, eager(x), atol=1e-5)


def test_compile_sizes_get_their_own_artifacts(tmp_path):
    torch.manual_seed(0)
    model = SillyModel(engine_config=_silly_config(tmp_path, compile_sizes=[4]), num_layers=2)
    eager = SillyModel(engine_config=_silly_config(tmp_path, mode="none"), num_layers=2)
    eager.load_state_dict(model.state_dict())
    with compilation_counter.expect(num_inductor_compiles=6):  # 3 distinct x (general, 4)
        model(torch.randn(3, 8))
    for n in (4, 5):
        x = torch.randn(n, 8)
        assert torch.allclose(model(x), eager(x), atol=1e-5)


def test_debug_mode_keeps_guards_and_never_recompiles(tmp_path):
    model = SillyModel(engine_config=_silly_config(tmp_path, debug=True), num_layers=2)
    with compilation_counter.expect(num_graphs_seen=1, num_recompiles=0):
        for n in (1, 2, 7, 64, 1):
            model(torch.randn(n, 8))
    assert model._compiled_forward.dispatch is None  # every call went through Dynamo


def test_eager_mode_compiles_nothing(tmp_path):
    model = SillyModel(engine_config=_silly_config(tmp_path, mode="none"))
    with compilation_counter.expect(num_graphs_seen=0, num_inductor_compiles=0):
        model(torch.randn(3, 8))


# -- forward recipes: no Dynamo on later calls, none at all in a warm start --------------


def _silly_pair(tmp_path, num_layers=3, **compilation):
    torch.manual_seed(0)
    model = SillyModel(engine_config=_silly_config(tmp_path, **compilation), num_layers=num_layers)
    eager = SillyModel(engine_config=_silly_config(tmp_path, mode="none"), num_layers=num_layers)
    eager.load_state_dict(model.state_dict())
    return model, eager


def test_recipe_replaces_dynamo_and_warm_starts(tmp_path):
    cold, eager = _silly_pair(tmp_path)
    with compilation_counter.expect(num_graphs_seen=1, num_warm_starts=0):
        cold(torch.randn(4, 8))
    assert isinstance(cold._compiled_forward.dispatch, RecipeRunner)
    assert len(list((tmp_path / "recipes").rglob("*.json"))) == 1

    warm, _ = _silly_pair(tmp_path)  # same module, config and cache: nothing to trace
    with compilation_counter.expect(
        num_graphs_seen=0, num_warm_starts=1, num_inductor_compiles=0, num_cache_hits=3
    ):
        warm(torch.randn(2, 8))
    for n in (1, 3, 17):
        x = torch.randn(n, 8)
        before = ATTENTION_CALLS[0]
        got = warm(x)
        assert ATTENTION_CALLS[0] - before == 3  # attention still runs between the pieces
        assert torch.allclose(got, eager(x), atol=1e-5)
        assert torch.equal(got, cold(x))


def test_recipe_not_shared_by_different_modules(tmp_path):
    """A plain attribute the forward loops over (the layer count) is part of the key."""
    _silly_pair(tmp_path, num_layers=2)[0](torch.randn(3, 8))
    model, eager = _silly_pair(tmp_path, num_layers=4)
    with compilation_counter.expect(num_graphs_seen=1, num_warm_starts=0):
        got = model(torch.randn(3, 8))
    x = torch.randn(5, 8)
    assert torch.allclose(model(x), eager(x), atol=1e-5) and got.shape == (3, 1)


def test_recipe_with_a_missing_artifact_traces_again(tmp_path):
    _silly_pair(tmp_path)[0](torch.randn(3, 8))
    next(tmp_path.rglob("piece_2.bin")).unlink()
    model, eager = _silly_pair(tmp_path)
    with compilation_counter.expect(num_graphs_seen=1, num_warm_starts=0, num_inductor_compiles=1):
        model(torch.randn(3, 8))
    x = torch.randn(6, 8)
    assert torch.allclose(model(x), eager(x), atol=1e-5)


@support_torch_compile
class DictModel(nn.Module):
    """Returns a dict: not expressible as a recipe, so Dynamo's bytecode keeps running."""

    def __init__(self, *, engine_config: EngineConfig, prefix: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": torch.tanh(x @ self.weight)}


def test_forward_without_a_recipe_runs_dynamo_bytecode(tmp_path):
    model = DictModel(engine_config=_silly_config(tmp_path))
    x = torch.randn(3, 8)
    with compilation_counter.expect(num_graphs_seen=1):
        first = model(x)
    assert not isinstance(model._compiled_forward.dispatch, RecipeRunner)
    assert not list(tmp_path.rglob("recipes/**/*.json"))
    assert torch.allclose(model(x)["y"], first["y"]) and torch.allclose(
        first["y"], torch.tanh(x @ model.weight), atol=1e-5
    )


def test_recipe_is_ignored_when_a_traced_file_changes(tmp_path):
    source = tmp_path / "model_source.py"
    source.write_text("x = 1\n")
    recipe = ForwardRecipe(
        cache_key="k",
        traced_files={str(source): file_digest(str(source))},
        inputs=["L['x']"],
        output={"kind": "tensor", "index": 0},
        split_code="def forward(self, x):\n    return (x,)\n",
        pieces=[],
    )
    path = tmp_path / "recipe.json"
    recipe.save(path)
    assert ForwardRecipe.load(path) == recipe
    source.write_text("x = 2\n")
    assert ForwardRecipe.load(path) is None
    path.write_text("{not json")
    assert ForwardRecipe.load(path) is None
    recipe.inputs = ["__import__('os').system('true')"]  # only lookups are accepted
    recipe.traced_files = {}
    recipe.save(path)
    assert ForwardRecipe.load(path) is None


# -- a small random Llama --------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_pair(tiny_llama, tmp_path_factory):
    cache = tmp_path_factory.mktemp("compile_cache")
    compiled, cfg = load_ours(
        tiny_llama[0], compilation_config=CompilationConfig(cache_dir=str(cache))
    )
    eager, eager_cfg = load_ours(tiny_llama[0])
    return compiled, cfg, eager, eager_cfg


def _hidden(model, cfg, ids):
    n = len(ids)
    with torch.inference_mode(), set_forward_context(AttentionMetadata.dense([n]), cfg):
        return model(ids, torch.arange(n))


def test_llama_first_call_traces_once(tiny_llama, tmp_path):
    cc = CompilationConfig(cache_dir=str(tmp_path), compile_sizes=[])
    compiled, cfg = load_ours(tiny_llama[0], compilation_config=cc)
    layers = cfg.model_config.hf_config.num_hidden_layers
    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * layers + 1,
        num_piecewise_capturable_graphs_seen=layers + 1,
        num_backend_compilations=layers + 1 if layers < 3 else 3,
        num_cache_misses=layers + 1 if layers < 3 else 3,
    ):
        _hidden(compiled, cfg, torch.tensor([1, 2, 3]))
    with compilation_counter.expect(num_graphs_seen=0):
        _hidden(compiled, cfg, torch.tensor([4]))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(n=st.integers(1, 256), seed=st.integers(0, 1000))
def test_llama_compiled_equals_eager_any_token_count(llama_pair, n, seed):
    compiled, cfg, eager, eager_cfg = llama_pair
    _hidden(compiled, cfg, torch.tensor([1]))  # the one compile happens here at most
    ids = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))
    with compilation_counter.expect(num_graphs_seen=0, num_recompiles=0, num_inductor_compiles=0):
        got = _hidden(compiled, cfg, ids)
    want = _hidden(eager, eager_cfg, ids)
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item() + 1e-6)


def test_llama_bf16_compiled_close_to_eager(tiny_llama, tmp_path):
    cc = CompilationConfig(cache_dir=str(tmp_path))
    compiled, cfg = load_ours(tiny_llama[0], dtype=torch.bfloat16, compilation_config=cc)
    eager, eager_cfg = load_ours(tiny_llama[0], dtype=torch.bfloat16)
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(0))
    got, want = _hidden(compiled, cfg, ids).float(), _hidden(eager, eager_cfg, ids).float()
    assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item()


def test_engine_greedy_compiled_equals_eager(tiny_llama, tmp_path):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42], [100 + i for i in range(40)]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cc = {"cache_dir": str(tmp_path)}
    compiled = LLM(str(tiny_llama[0]), compilation_config=cc, max_num_batched_tokens=32)
    eager = LLM(str(tiny_llama[0]), enforce_eager=True, max_num_batched_tokens=32)
    with compilation_counter.expect(num_graphs_seen=0, num_recompiles=0):
        got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want


# -- property tests with compilecore.testing -------------------------------------------
def _call(model, cfg):
    def run(ids, positions):
        with set_forward_context(AttentionMetadata.dense([len(ids)]), cfg):
            return model(ids, positions)

    return run


@pytest.mark.slow
# Each example is a cold compile of a fresh model (~12 s on an empty cache): three keep the
# suite in its budget; the drawn configs differ on every run.
@testing.settings(max_examples=3)
@given(
    config=testing.llama_configs(max_layers=2),
    sizes=st.lists(testing.token_counts(64), min_size=2, max_size=4),
)
def test_any_llama_config_compiled_equals_eager(tmp_path_factory, config, sizes):
    path = tmp_path_factory.mktemp("drawn")
    save_checkpoint(path, config)
    cc = CompilationConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))
    compiled = _call(*load_ours(path, compilation_config=cc))
    eager = _call(*load_ours(path))
    for n in sizes:
        ids = torch.randint(0, config.vocab_size, (n,))
        # The first call compiles; every later size must run the same code.
        testing.assert_compiled_matches_eager(compiled, eager, ids, torch.arange(n))


@testing.settings(max_examples=30)
@given(spec=testing.batches(max_seqs=3, max_context=20, max_query=12))
def test_padding_invariance(tiny_llama, padded_llm, spec):
    """Padding a batch up to a CUDA-graph size (token 0, position 0, written nowhere)
    leaves every real row's result unchanged."""
    plain, padded = padded_llm
    prompts = [ids[: c + q] for ids, (c, q) in zip(spec.token_ids, spec.seqs)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.fixture(scope="module")
def padded_llm(tiny_llama, tmp_path_factory):
    cc = {"cache_dir": str(tmp_path_factory.mktemp("pad_cache"))}
    plain = LLM(str(tiny_llama[0]), compilation_config=cc)
    padded = LLM(str(tiny_llama[0]), compilation_config=cc)
    # The padding path CUDA graphs use, exercised on CPU: pad each batch to these sizes.
    padded.llm_engine.runner.capture_sizes = [4, 8, 16, 32, 64, 128]
    assert padded.llm_engine.runner.padded_size(5) == 8
    return plain, padded


def test_vector_isa_probes_are_remembered(tmp_path):
    """A process whose probes all passed leaves a marker; later blocks trust the CPU."""
    from torch._inductor import cpu_vec_isa

    from compilecore.inductor_env import _marker, _probes_all_passed, trusted_vec_isa

    if _marker(tmp_path) is None:
        pytest.skip("the probes are only skipped on x86-64 Linux")
    cpu_vec_isa.valid_vec_isa_list()  # this process's probes (already run by any compile)
    with trusted_vec_isa(tmp_path):
        assert torch._inductor.config.cpp.vec_isa_ok is None  # first time: probe
    assert _marker(tmp_path).exists() == _probes_all_passed()
    if _marker(tmp_path).exists():
        with trusted_vec_isa(tmp_path):
            assert torch._inductor.config.cpp.vec_isa_ok is True
        assert torch._inductor.config.cpp.vec_isa_ok is None  # only inside the block


@support_torch_compile
class BranchesOnTokenCount(nn.Module):
    """Deliberately breaks the rule: Python control flow on the number of tokens."""

    def __init__(self, *, engine_config: EngineConfig, prefix: str = ""):
        super().__init__()
        self.prefix = prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            return x * 2.0
        return x + 1.0


def _failing_pass(graph) -> int:
    raise ValueError("a broken pass, not the token count")


def test_a_failure_inside_the_backend_is_not_blamed_on_the_token_count(tmp_path):
    """A pass that raises: its own error comes out, not the token-count rule (Inductor's
    message names the pieces' arguments, the sizes u0 and u1 among them)."""
    from compilecore.decorators import DataDependentShapeError

    torch._dynamo.reset()
    config = _silly_config(tmp_path, custom_passes=[_failing_pass])
    model = SillyModel(engine_config=config, num_layers=1)
    with pytest.raises(Exception, match="a broken pass") as info:
        model(torch.randn(3, 8))
    assert not isinstance(info.value, DataDependentShapeError)


def test_branching_on_the_token_count_is_named_as_the_rule(tmp_path):
    from compilecore.decorators import DataDependentShapeError

    torch._dynamo.reset()
    model = BranchesOnTokenCount(engine_config=_silly_config(tmp_path))
    with pytest.raises(DataDependentShapeError, match="may not depend on the token count.*debug"):
        model(torch.randn(3, 8))


@pytest.mark.parametrize("quantized_linear", [False, True])
def test_static_size_code_leaves_inductors_dequantization_unrealized(tmp_path, quantized_linear):
    """Code for a static token count realizes every pointwise value that feeds a reduction
    (the activations, computed once), except in a piece where Inductor dequantizes a weight
    itself (no native quantized product takes it): there the dequantized weight is such a
    value, and realized it would be written out whole in fp32 every step."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import passes.ops.quantized  # noqa: F401 - registers compilecore.dequantize_q4
    from compilecore.backend import STATIC_SIZE_OPTIONS, CompilecoreBackend
    from passes.config import PassConfig
    from passes.manager import PostGradPassManager

    x, w = torch.randn(1, 32), torch.randint(0, 255, (8, 16), dtype=torch.uint8)
    s, m = torch.rand(8, 1, dtype=torch.float16), torch.rand(8, 1, dtype=torch.float16)

    def layer(x, w, s, m):
        return x @ torch.ops.compilecore.dequantize_q4(w, s, m, torch.float32).T

    quantized = make_fx(layer)(x, w, s, m)
    plain = make_fx(lambda x, w: x @ w.T)(x, torch.randn(8, 32))
    manager = PostGradPassManager(PassConfig(quantized_linear=quantized_linear))
    backend = CompilecoreBackend(_silly_config(tmp_path), "test", manager)

    def realizes(static: bool, gm) -> bool:
        patches = backend.inductor_options(static=static, gm=gm)["config_patches"]
        return STATIC_SIZE_OPTIONS.items() <= patches.items()

    assert realizes(True, plain) and not realizes(False, plain)
    assert realizes(True, quantized) == quantized_linear
