"""docs/passes.md's property-test example, as written there (tests/test_docs.py checks
that the doc shows this test's code). It must run under pytest out of the box: no deadline
failures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given

from compilecore import testing
from runtime.testing import compiled_eager_pair
from tests.helpers import llama_config

pytestmark = pytest.mark.slow


# --- docs example start ---
@testing.settings(max_examples=4)
@given(config=testing.llama_configs(max_layers=2), n=testing.token_counts(32))
def test_compiled_equals_eager(config, n):
    compiled, eager = compiled_eager_pair(config)
    ids, positions = torch.randint(0, config.vocab_size, (n,)), torch.arange(n)
    testing.assert_compiled_matches_eager(compiled, eager, ids, positions)


# --- docs example end ---


def test_the_pair_shares_weights_and_differs_from_another_seed():
    config = llama_config()
    compiled, eager = compiled_eager_pair(config, seed=1)
    ids, positions = torch.tensor([5, 9, 2, 7]), torch.arange(4)
    with torch.inference_mode():
        assert torch.allclose(compiled(ids, positions), eager(ids, positions), atol=1e-5)
        other = compiled_eager_pair(config, seed=2)[1](ids, positions)
    assert not torch.allclose(eager(ids, positions), other)


def test_the_pairs_own_cache_is_removed_when_the_process_exits(tmp_path):
    # A user's test session makes many pairs; each one's temporary compile cache must not
    # outlive the process (they piled up in /tmp by the hundred).
    script = (
        "import os, tempfile\n"
        "from runtime.testing import compiled_eager_pair\n"
        "from tests.helpers import llama_config\n"
        "compiled_eager_pair(llama_config(num_hidden_layers=1))\n"
        "print(sorted(os.listdir(tempfile.gettempdir())))\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compilecore-testing-" in run.stdout  # it existed while the process ran
    assert not [p for p in os.listdir(tmp_path) if p.startswith("compilecore-testing-")]
