"""What a model author needs to test a model under the compiler, with
`compilecore.testing`'s strategies and assertions (this half needs the model registry and
the attention backends, which live above compilecore):

    from hypothesis import given
    from compilecore import testing
    from runtime.testing import compiled_eager_pair

    @testing.settings()
    @given(config=testing.llama_configs(max_layers=2), n=testing.token_counts(32))
    def test_compiled_equals_eager(config, n):
        compiled, eager = compiled_eager_pair(config)
        ids, positions = torch.randint(0, config.vocab_size, (n,)), torch.arange(n)
        testing.assert_compiled_matches_eager(compiled, eager, ids, positions)
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from compilecore.config import CompilationConfig, EngineConfig
from compilecore.forward_context import set_forward_context
from models.loader import build_model
from runtime.attention import AttentionMetadata
from runtime.attention.dense import DenseAttentionBackend


def _model(hf_config: Any, dtype: torch.dtype, compilation: CompilationConfig):
    config = EngineConfig.for_hf_config(hf_config, dtype=dtype, compilation_config=compilation)
    model = build_model(config)
    for layer in config.compilation_config.static_forward_context.values():
        layer.bind(DenseAttentionBackend())  # the oracle attention, no KV cache needed
    return model, config


def compiled_eager_pair(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | None = None,
    seed: int = 0,
    **compilation: Any,
) -> tuple[Callable, Callable]:
    """Two callables `(input_ids, positions) -> hidden states` over the model the
    registry builds for `hf_config`, on the same random weights: one compiled (with
    `compilation` as extra compilation_config fields), one eager. Each sets the forward
    context of one packed sequence with dense attention. Without `cache_dir` the compiled
    side uses a temporary cache, removed when the process exits."""
    if cache_dir is None:  # a cache of our own, removed when the process ends
        cache_dir = tempfile.mkdtemp(prefix="compilecore-testing-")
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    compiled, compiled_config = _model(
        hf_config, dtype, CompilationConfig(cache_dir=cache_dir, **compilation)
    )
    eager, eager_config = _model(hf_config, dtype, CompilationConfig(mode="none"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in compiled.parameters():  # built uninitialised: draw every weight
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if p.dim() == 1 else 0.08 * noise)  # norms near 1
    eager.load_state_dict(compiled.state_dict())

    def runner(model, config) -> Callable:
        def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            with set_forward_context(AttentionMetadata.dense([len(input_ids)]), config):
                return model(input_ids, positions)

        return run

    return runner(compiled, compiled_config), runner(eager, eager_config)
