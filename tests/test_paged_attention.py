"""The torch paged-attention backend equals dense causal attention computed from scratch,
for drawn block sizes, context and query lengths, GQA ratios and mixed batches."""

from __future__ import annotations

from hypothesis import given, settings

from runtime.attention import TorchPagedAttentionBackend
from tests.attention_cases import batches, build_case, run_and_check


@settings(max_examples=40, deadline=None)
@given(batches())
def test_paged_equals_dense(batch):
    run_and_check(build_case(batch), TorchPagedAttentionBackend())
