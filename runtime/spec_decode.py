"""Speculative decoding (vLLM's `speculative_config`), verified through the ordinary
compiled step.

Proposing, method "ngram": where a request's last n tokens (n from `prompt_lookup_max`
down to `prompt_lookup_min`) occurred earlier in its prompt or output, the tokens that
followed the longest such occurrence are proposed, up to `num_speculative_tokens`. Method
"draft_model": a smaller model with the same tokenizer, run as an engine of its own (its
compiled graphs and CPU or CUDA graphs, its KV cache), decodes each proposing request's
next tokens greedily in a sequence of its own that lives as long as the request: between
proposals it is held (its KV kept, not scheduled); the next proposal rewinds it to the
tokens it shares with the request (the accepted drafts) and appends the request's newer
ones, then decodes k + 1 tokens (the last draft is computed too, so that the next proposal
starts with a decode step whatever verification kept), as vLLM's draft model keeps its KV
(`DraftModelProposer`).

Verifying: a decoding request with proposals d1..dk is scheduled as a query of 1 + k
tokens (its last token, then d1..dk) at the next positions: a chunk of an ordinary step,
through the same compiled pieces and paged attention, whose logits rows 0..k are each the
next-token distribution after the tokens before it. Greedy: row i's argmax t_i is the
token decoding one at a time would give once d1..di are right, so d_{i+1} is accepted
while it equals t_i; the first t_i that differs (or t_k after all k) is emitted too. The
KV of the accepted tokens stays; the rejected positions' slots are overwritten by the next
step (attention never reads a position past a query's own), and the request's computed
count steps back over them. Sampled requests keep draft i with the probability their own
filtered distribution at row i gives it, and draw the first refused one again without it
(`sample_verified`): every emitted token has the distribution one-at-a-time sampling
gives it, from the request's own seeded draws. Requests with logprobs or logits processing
other than a grammar do not speculate; the others in the same step decode as usual. Under
a grammar the drafts stop before the first token it refuses, and row i of a verification
is masked by the grammar's state after d1..di before it is read.

Never slower: a verification step costs more than a decode step (on this CPU 2.2-2.5 for
4 tokens; on a GPU a few percent), so it pays only where it emits at least
`min_tokens_per_verification` tokens. A lookup costs nothing to check without verifying
it: a request starts by watching its lookups (`SpecState.shadow`), each judged by the
tokens the request goes on to emit as its verification would have been, and sends drafts
only while its lookups (watched or verified, each outcome weighing as much as all before
it: `SpecState.score`) emit enough; free text, whose lookups rarely come true, so runs
as plain decoding but for a verification after a chance repetition. A draft model's
proposals cost a run of the draft, so a request whose verifications do not pay pauses
instead, doubling.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from compilecore.config import SpeculativeConfig
from runtime.request import Request, SpecState
from runtime.sampling_params import SamplingParams

# With a draft model, a request whose speculation does not pay stops proposing for
# FIRST_PAUSE steps, doubling each time up to MAX_PAUSE.
FIRST_PAUSE = 4
MAX_PAUSE = 64


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest suffix of
    `tokens` of n_min..n_max tokens: of the longest, the one with the most tokens after
    it (up to k), the latest of those; [] where none occurred."""
    last = len(tokens) - 1
    best, best_key = None, (0, 0, -1)
    for end in range(last - 1, -1, -1):  # each earlier place the last token occurred
        if tokens[end] != tokens[last]:
            continue
        n = 1
        while n < n_max and n <= end and tokens[end - n] == tokens[last - n]:
            n += 1
        key = (n, min(k, last - end), end)
        if n >= n_min and key > best_key:
            best, best_key = end, key
    return [] if best is None else tokens[best + 1 : best + 1 + k]


def sample_verified(
    probs: torch.Tensor, drafts: list[int], uniform: Callable[[], float]
) -> list[int]:
    """The tokens a sampled request emits for its drafts (Leviathan et al. / Chen et al.'s
    rule, vLLM's, with a draft that had probability 1 to its proposer): draft i is kept
    with the probability row i gives it; the first one refused is replaced by a draw from
    row i without it (renormalized), and when all are kept one more is drawn from the
    last row. Each token so has row i's distribution. `probs` [len(drafts) + 1, vocab]:
    the request's filtered distributions; `uniform` its draws in [0, 1)."""
    emitted = []
    for i, draft in enumerate(drafts):
        p = probs[i, draft].item()
        if uniform() < p:
            emitted.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        return emitted + [_inverse_cdf(residual, uniform())]
    return emitted + [_inverse_cdf(probs[len(drafts)], uniform())]


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The token whose cumulative weight first exceeds u x the total (never a 0 one)."""
    cdf = weights.double().cumsum(0)
    token = int(torch.searchsorted(cdf, u * cdf[-1].item(), right=True).item())
    token = min(token, len(cdf) - 1)
    while weights[token] == 0 and token > 0:  # u x total rounded onto a flat run's end
        token -= 1
    return token


def accepted_length(targets: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target tokens decoded after the ones before."""
    n = 0
    while n < min(len(drafts), len(targets)) and targets[n] == drafts[n]:
        n += 1
    return n


def _allowed(req: Request, drafts: list[int]) -> list[int]:
    """The drafts a request's grammar allows (all where it has none)."""
    return drafts if req.grammar is None or not drafts else req.grammar.allowed_prefix(drafts)


class Proposer:
    """Drafts for each decoding request, and when to stop proposing: speculation pays
    while a request's verifications emit more tokens than a verification step costs in
    plain steps (benchmarks/bench_spec.py measures that cost). The decision reads the fixed
    `min_tokens_per_verification` and the request's own counts only: which steps verify
    changes the shapes its tokens are computed in, and that must not depend on timing."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose_all(self, running: list[Request]) -> None:
        """Each running request's drafts for the next step (`req.spec.drafts`)."""
        for req in running:
            req.spec.drafts = self.propose(req)

    def propose(self, req: Request) -> list[int]:
        """The drafts for `req`'s next step, or [] (not decoding, not plain, near its end,
        watching, or nothing found). A watched lookup is judged once the tokens after it
        differ from it or it has been emitted whole."""
        c = self.config
        limit = self.limit(req)
        if limit < 1:
            return []
        state = req.spec
        if state.shadow:
            emitted = req.all_token_ids[state.shadow_at :]
            accepted = accepted_length(emitted, state.shadow)
            if accepted == len(emitted) < len(state.shadow):
                return []  # right so far: the tokens that judge it are still to come
            self._judge(state, accepted)
            state.shadow = []
        drafts = ngram_proposal(req.all_token_ids, limit, c.prompt_lookup_min, c.prompt_lookup_max)
        drafts = _allowed(req, drafts)
        if drafts and not self.pays(state):
            state.shadow, state.shadow_at = drafts, req.num_tokens
            return []
        return drafts

    def limit(self, req: Request) -> int:
        """How many drafts `req` may take next step: 0 where it is not decoding, not plain,
        near its end or paused (a paused request's pause counts down here)."""
        state = req.spec
        if not self.eligible(req):
            return 0
        if state.pause:
            state.pause -= 1
            return 0
        limit = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:  # the last allowed token needs no draft after it
            limit = min(limit, max_tokens - len(req.output_token_ids) - 1)
        return max(limit, 0)

    @staticmethod
    def eligible(req: Request) -> bool:
        return (
            # greedy, or sampled from temperature / top-k / top-p / min-p alone, or either
            # under a grammar (its drafts cut where it refuses one: `_allowed`)
            (req.plain or req.plain_but_grammar)
            and req.sampling_params.prompt_logprobs is None
            and req.num_pending == 0
            and req.num_computed_tokens == req.num_tokens - 1
        )

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verification's outcome: the request's counts, and the judgement."""
        state = req.spec
        state.num_drafts += 1
        state.num_draft_tokens += drafted
        state.num_accepted_tokens += accepted
        self._judge(state, accepted)

    def pays(self, state: SpecState) -> bool:
        """Whether a verification is expected to emit at least the floor's tokens (always
        with floor 1; never before an outcome with a higher one)."""
        return 1 + state.score >= (self.config.min_tokens_per_verification or 1.0)

    def _judge(self, state: SpecState, accepted: int) -> None:
        state.score = (state.score + accepted) / 2

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted (nothing kept for it here)."""


class DraftModelProposer(Proposer):
    """Drafts from a draft model's engine (`draft`: an LLMEngine on the smaller model, no
    prefix caching: its sequences are rewound): each request has a greedy sequence there
    (`sequences`), run on for as many tokens as the request may take; they come back as its
    drafts. A greedy draft proposes each token with probability 1, so the verification
    rules are the n-gram method's (`sample_verified`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft):
        super().__init__(config, max_model_len)
        self.draft = draft
        self._ids = itertools.count()
        self.sequences: dict[str, Request] = {}  # by the request's id

    def forget(self, request_id: str) -> None:
        """The request finished or left: its sequence's KV goes back to the draft engine."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.draft.abort_request(seq.request_id)

    def _sequence(self, req: Request) -> Request:
        """`req`'s sequence in the draft engine with `req`'s tokens: the one kept since the
        last proposal, rewound to the tokens both share (its KV past them is computed again
        or overwritten) with `req`'s newer tokens after them; or a new one."""
        seq = self.sequences.get(req.request_id)
        tokens = req.all_token_ids
        if seq is not None and not seq.is_finished:
            agree = _shared_prefix(seq.all_token_ids, tokens)
            if agree >= seq.num_prompt_tokens:
                del seq.all_token_ids[agree:]
                del seq.output_token_ids[agree - seq.num_prompt_tokens :]
                for token in tokens[agree:]:
                    seq.append_token(token)
                seq.num_computed_tokens = min(seq.num_computed_tokens, agree)
                return seq
        self.forget(req.request_id)
        params = SamplingParams(temperature=0, max_tokens=self.max_model_len, ignore_eos=True,
                                detokenize=False)  # fmt: skip
        seq = Request(f"draft-{next(self._ids)}", list(tokens), params)
        self.draft.add_request(seq)
        self.sequences[req.request_id] = seq
        return seq

    def _judge(self, state: SpecState, accepted: int) -> None:
        """Below the floor: no proposals for a pause, doubling up to MAX_PAUSE steps while
        the request stays below."""
        super()._judge(state, accepted)
        if self.pays(state):
            state.next_pause = FIRST_PAUSE
        else:
            state.pause = state.next_pause
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE)

    def propose_all(self, running: list[Request]) -> None:
        for gone in self.sequences.keys() - {req.request_id for req in running}:
            self.forget(gone)  # preempted (a finished one is forgotten by the engine)
        asked = []  # (request, its sequence, the request's length, drafts wanted)
        for req in running:
            req.spec.drafts = []
            limit = self.limit(req)
            if limit >= 1:
                asked.append((req, self._sequence(req), req.num_tokens, limit))
        # A step a token, each sequence held once it has its drafts and one token more:
        # computing the last draft now makes the next proposal's first step a decode
        # whatever verification keeps (with all drafts accepted it would be a two-token
        # chunk, piece by piece on CPU).
        while True:
            for _, seq, n, k in asked:
                seq.held = seq.is_finished or seq.num_tokens > n + k
            if all(seq.held for _, seq, _, _ in asked):
                break
            self.draft.step()
        for req, seq, n, k in asked:
            req.spec.drafts = _allowed(req, seq.all_token_ids[n : n + k])


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
