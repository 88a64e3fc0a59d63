"""The all-reduce + RMSNorm fusion on a real 2-process gloo group."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from tests.dist_workers import allreduce_fusion_worker

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_allreduce_rms_norm_fusion_two_ranks(tmp_path):
    mp.spawn(allreduce_fusion_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["allreduce_before"] == 1
        assert result["matches"] == 1 and result["fused_ops"] == 1
        assert result["allreduce_after"] == 0
        assert result["max_diff"] <= 1e-5
        assert result["full"] <= 1e-4  # the reduction really summed both ranks' halves
