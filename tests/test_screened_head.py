"""The screened batch-1 LM head (greedy steps read an int8 copy and compute exactly only
the rows that can win, passes/ops/gemv.py) where its bounds could cut the winner: under
tensor parallelism with a padding row and only negative logits, and with a head bias."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from models.layers.logits_processor import LogitsProcessor
from models.layers.vocab_embedding import ParallelLMHead
from passes.ops import gemv
from tests.dist_workers import screened_head_worker
from tests.test_allreduce_fusion import free_port

pytestmark = pytest.mark.skipif(not gemv.screen_available(), reason="no screened head here")


@pytest.mark.distributed
def test_tp2_odd_vocabulary_with_negative_logits_keeps_the_argmax(tmp_path):
    """321 tokens on 2 ranks: the last rank holds 160 rows and a padding row of zeros.
    Screened with the padding row, its exact logit 0 set the cut-off above every real
    row, so that rank's winner was cut whenever all logits were negative."""
    mp.spawn(screened_head_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        for case in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert case["max_exact"] < 0 and case["margin"] > 1e-3  # what the case is for
            assert case["argmax"] == case["exact"], case


def test_a_head_bias_is_seen_before_rows_are_cut():
    """A row whose product is far below the best but whose bias makes it win: a screen
    that cuts before the bias is added returned another token."""
    vocab, hidden = 300, 128
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.05).bfloat16()
    head = ParallelLMHead(vocab, hidden, bias=True, params_dtype=torch.bfloat16)
    head.weight_loader(head.weight, weight)
    h = torch.randn(1, hidden, generator=gen).bfloat16()
    exact = F.linear(h.double(), weight.double())[0]
    loser = int(exact.argmin())
    bias = torch.zeros(vocab, dtype=torch.bfloat16)
    bias[loser] = float(exact.max() - exact.min()) + 1.0
    head.weight_loader(head.bias, bias)
    processor = LogitsProcessor(vocab, small_batch_gemv=torch.ops.compilecore.gemv_logits)
    processor.set_argmax_only(True)
    assert int(processor(head, h)[0].argmax()) == loser
