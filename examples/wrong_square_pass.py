"""A deliberately wrong user pass, for the verifier to catch: `pow(x, 2) -> mul(x, 2)`.

RMSNorm squares its input (`mean(pow(x, 2))`); the rewrite doubles it instead, so the
norm takes the root of a mean that can be negative (NaN) or is plainly wrong, and a
model would go on generating from it. The verifier compares with the unfused graph:

    LLM(model, compilation_config={"custom_passes": [WrongSquarePass()],
                                   "passes": {"verify": True}})
    # PassVerificationError: pass wrong_square on piece_0_size_1: output 0 NaN at ... position(s)
"""

from __future__ import annotations

import torch
from torch import fx

from passes import GraphPass

aten = torch.ops.aten


class WrongSquarePass(GraphPass):
    name = "wrong_square"

    def __call__(self, graph: fx.Graph) -> int:
        matched = 0
        for node in graph.find_nodes(op="call_function", target=aten.pow.Tensor_Scalar):
            if node.args[1] == 2:
                node.target = aten.mul.Tensor  # x * 2, not x * x
                matched += 1
        return matched
