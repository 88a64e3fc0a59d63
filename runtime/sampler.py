"""Turns the logits of the rows that sample into tokens.

Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k,
top-p and min-p, and sampled by the exponential race (argmax of p / q with q ~ Exp(1)),
which equals sampling from p. A request with a seed draws its noise from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token id: logprob} of the top-n tokens and the sampled one, or None.
    logprobs: list[dict[int, float] | None]


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        logits = logits.float()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if logits.device.type == "cpu" and not random_rows:
            # numpy's argmax is vectorized; torch's takes ~10x longer on a 49k vocabulary,
            # which is a visible share of a batch-1 decode step. Ties: the first index.
            token_list = logits.numpy().argmax(axis=-1).tolist()
            return SamplerOutput(token_list, self._logprobs(logits, params, token_list))
        greedy = logits.argmax(dim=-1)
        tokens = greedy
        if random_rows:
            tokens = greedy.clone()
            rows = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample(
                logits[rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )
            tokens[rows] = sampled
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, params, token_list))

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(p.uses_top_k or p.top_p < 1.0 for p in params):
            top_k = torch.tensor(
                [p.top_k if p.uses_top_k else vocab for p in params], device=logits.device
            )
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            logits = _apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs)
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g or self.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
    ) -> list[dict[int, float] | None]:
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        # Raw model logprobs (before temperature and filtering), as vLLM reports them.
        logprobs = logits.log_softmax(dim=-1)
        top_n = max(n or 0 for n in wanted)
        top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        out: list[dict[int, float] | None] = []
        for i, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            entry = {tokens[i]: logprobs[i, tokens[i]].item()}
            if n:
                entry.update(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
            out.append(entry)
        return out
