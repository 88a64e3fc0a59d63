"""Holes in the compile layer that made a warm start silently stale or a test silently
weak: a helper that steers tracing without emitting an op, a parameter replaced after
compilation, a recompile hidden by a warm-up call."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from compilecore import testing
from compilecore.config import CompilationConfig, EngineConfig
from compilecore.counters import compilation_counter
from compilecore.decorators import support_torch_compile
from compilecore.recipe import RecipeRunner

HELPER = "def use_tanh():\n    return {flag}\n"


@support_torch_compile
class SteeredModel(nn.Module):
    """Which activation runs is decided by a helper in another file, which emits no op
    itself (so no node's stack trace names that file)."""

    def __init__(self, *, engine_config: EngineConfig, prefix: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        helper = sys.modules["compilecore_steering_helper"]
        y = x @ self.weight
        return torch.tanh(y) if helper.use_tanh() else torch.relu(y)


def _config(cache_dir) -> EngineConfig:
    cc = CompilationConfig(cache_dir=str(cache_dir), compile_sizes=[], splitting_ops=[])
    hf = SimpleNamespace(name="steered", max_position_embeddings=64)
    return EngineConfig.for_hf_config(hf, compilation_config=cc)


@pytest.fixture
def helper_module(tmp_path, monkeypatch):
    folder = tmp_path / "src"
    folder.mkdir()
    path = folder / "compilecore_steering_helper.py"
    path.write_text(HELPER.format(flag="True"))
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module("compilecore_steering_helper")
    yield path, module
    sys.modules.pop("compilecore_steering_helper", None)


def test_an_edited_helper_file_forces_a_retrace(tmp_path, helper_module):
    path, module = helper_module
    torch.manual_seed(0)
    first = SteeredModel(engine_config=_config(tmp_path / "cache"))
    x = torch.randn(3, 8)
    with compilation_counter.expect(num_graphs_seen=1):
        assert torch.allclose(first(x), torch.tanh(x @ first.weight), atol=1e-5)
    assert isinstance(first._compiled_forward.dispatch, RecipeRunner)

    path.write_text(HELPER.format(flag="False") + "# edited\n")
    importlib.reload(module)
    second = SteeredModel(engine_config=_config(tmp_path / "cache"))
    second.load_state_dict(first.state_dict())
    with compilation_counter.expect(num_graphs_seen=1, num_warm_starts=0):  # traced again
        assert torch.allclose(second(x), torch.relu(x @ first.weight), atol=1e-5)


def test_a_replaced_parameter_is_used_by_the_recipe(tmp_path, helper_module):
    model = SteeredModel(engine_config=_config(tmp_path / "cache"))
    x = torch.randn(5, 8)
    model(x)
    warm = SteeredModel(engine_config=_config(tmp_path / "cache"))
    with compilation_counter.expect(num_graphs_seen=0, num_warm_starts=1):
        warm(x)
    assert isinstance(warm._compiled_forward.dispatch, RecipeRunner)
    new = torch.randn(8, 8)
    warm.load_state_dict({"weight": new}, assign=True)  # a new Parameter object
    assert torch.allclose(warm(x), torch.tanh(x @ new), atol=1e-5)
    warm.weight = nn.Parameter(new * 2, requires_grad=False)
    assert torch.allclose(warm(x), torch.tanh(x @ (new * 2)), atol=1e-5)


def test_assert_compiled_matches_eager_catches_a_shape_specialising_model():
    def f(x):
        return torch.sin(x) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, dynamic=False)  # specialises on every shape it sees
    testing.assert_compiled_matches_eager(compiled, f, torch.randn(4))  # first: may compile
    testing.assert_compiled_matches_eager(compiled, f, torch.randn(4))  # same shape: fine
    with pytest.raises(AssertionError, match="recompiled"):
        testing.assert_compiled_matches_eager(compiled, f, torch.randn(5))
