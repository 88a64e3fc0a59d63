"""Async scheduling (vLLM's `async_scheduling`): step N+1 is launched before step N's
tokens reach the host.

A step whose requests are all plain (no logprobs, no logits processing, no grammar) draws
its tokens on the device (inside its full CUDA graph, else `Sampler.device_tokens`: one
Triton pass a row, runtime/sample_kernel.py) and starts copying the ids to the host; it is
an `InflightStep` until the engine reads them. Meanwhile the scheduler plans the next step
with each of those requests one token longer (`Request.num_pending`): the token whose id
is still on the device. The runner writes that step's inputs as usual and then gathers the
pending ids straight from the previous step's device tensor into `input_ids` (`Feed`), so
no host round trip stands between two steps. After launching step N+1 the engine reads
step N's ids (by then computed: the device has moved on to N+1), appends them and applies
stop conditions: one step late, as vLLM does. A request that stopped at step N was also
computed in step N+1; that token is discarded, and the KV it wrote lies in blocks freed
with the request (the device writes them before any later step reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.request import Request


@dataclass
class Feed:
    """Input ids that live on the device: `input_ids[dst[i]] = source[src[i]]`."""

    source: torch.Tensor
    dst: list[int]
    src: list[int]


class InflightStep:
    """A launched step's tokens, on their way to the host (a pinned buffer and an
    event on a GPU; already there on CPU)."""

    def __init__(self, requests: list[Request], tokens: torch.Tensor):
        self.requests = requests
        # The next step's feed, on the device: a row with no token feeds id 0 (its request
        # ends when read, and what the next step computed for it is dropped).
        self.tokens = tokens.clamp_min(0)
        self.rows = {req.request_id: i for i, req in enumerate(requests)}
        self.event = None
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens
        for req in requests:
            req.num_pending += 1

    def feed(self, fed: list[tuple[int, str]]) -> Feed | None:
        """Where the plan's device-held input ids come from: plan rows `fed` as (token
        index, request id), each request's row of this step's tokens."""
        if not fed:
            return None
        return Feed(self.tokens, [d for d, _ in fed], [self.rows[rid] for _, rid in fed])

    def host_tokens(self) -> list[int]:
        """The ids, waiting for their copy (and so for this step) to finish."""
        if self.event is not None:
            self.event.synchronize()
        for req in self.requests:
            req.num_pending -= 1
        return self.host.tolist()
