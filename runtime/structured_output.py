"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regex,
a choice of strings or an EBNF grammar, with xgrammar (vLLM's default engine).

Each constrained request owns a grammar matcher. Before a step samples, the matcher's
bitmask of the tokens that may come next masks the request's row (`-inf` elsewhere),
in `runtime.sampler.process_logits` on the copy of the logits every processed row gets
(so logprobs stay those of the raw distribution, and unconstrained rows of the same
batch keep the compiled step's fast path). After the step, the sampled token advances
the matcher; once the grammar is complete, the request stops. Speculation (runtime/
spec_decode.py): drafts are cut at the first token the grammar refuses, and each of a
verification's rows is masked by the grammar's state after the drafts before it.

Grammars compile once per (kind, spec) and engine: a schema that does not compile is a
ValueError before the request is queued (a 400 through the server).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import torch

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` (its `GuidedDecodingParams` before): exactly one
    of a JSON schema (a dict or its JSON text), a regex, a list of choices, an EBNF
    grammar, or `json_object=True` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's option: no whitespace between JSON tokens (a model that pads with spaces
    # cannot then run on forever).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What the compiled grammar depends on."""
        spec = getattr(self, self.kind)
        text = json.dumps(spec, sort_keys=True) if not isinstance(spec, str) else spec
        return self.kind, text, self.disable_any_whitespace

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {unknown}")
            return cls(**value)
        raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict")


class GrammarCompilerCache:
    """One xgrammar compiler for an engine's tokenizer and vocabulary; compiled grammars
    kept by what they depend on."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info)
        self.compiled: dict[tuple, Any] = {}

    def compile(self, params: StructuredOutputsParams) -> Any:
        key = params.key()
        if key not in self.compiled:
            self.compiled[key] = self._compile(params)
        return self.compiled[key]

    def _compile(self, p: StructuredOutputsParams) -> Any:
        c, whitespace = self.compiler, not p.disable_any_whitespace
        try:
            if p.kind == "json":
                return c.compile_json_schema(json.dumps(p.json), any_whitespace=whitespace)
            if p.kind == "json_object":  # OpenAI's json_object: an object, not any value
                return c.compile_json_schema('{"type": "object"}', any_whitespace=whitespace)
            if p.kind == "regex":
                return c.compile_regex(p.regex)
            if p.kind == "choice":
                grammar = "root ::= " + " | ".join(json.dumps(c) for c in p.choice)
                return c.compile_grammar(grammar)
            return c.compile_grammar(p.grammar)
        except Exception as e:  # xgrammar's own errors: the spec is the caller's
            raise ValueError(f"structured_outputs.{p.kind} does not compile: {e}") from None

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self._xgr, self.compile(params), self.vocab_size)


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int):
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, row: torch.Tensor) -> None:
        """-inf on the tokens of `row` (one row of logits) the grammar does not allow next."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        bitmask = self.bitmask.to(row.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(row[None], bitmask)

    def allowed_prefix(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first the grammar refuses (or that would end it: a row
        after the grammar's end has no mask), the matcher left where it was."""
        n = 0
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            n += 1
            if self.matcher.is_terminated():
                n -= 1
                self.matcher.rollback(1)
                break
        if n:
            self.matcher.rollback(n)
        return drafts[:n]

    def mask_rows(self, rows: torch.Tensor, drafts: list[int]) -> None:
        """-inf on the tokens of each of a verification's rows (len(drafts) + 1, in place)
        that the grammar does not allow after the drafts before it (`allowed_prefix`'s)."""
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i in range(len(rows)):
            self.matcher.fill_next_token_bitmask(bitmask, i)
            if i < len(drafts):
                self.matcher.accept_token(drafts[i])
        if drafts:
            self.matcher.rollback(len(drafts))
        self._xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device, non_blocking=True))

    def accept(self, token: int) -> bool:
        """Advances past `token`; False where the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def complete(self) -> bool:
        return self.matcher.is_terminated()


def from_request(
    response_format: dict | None,
    structured_outputs: dict | None,
    guided: dict[str, Any],
) -> StructuredOutputsParams | None:
    """The structured output an OpenAI request asks for: OpenAI's `response_format`
    (`json_object`, `json_schema`; `text` is none), vLLM's `structured_outputs`, or its
    older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (`guided`:
    those fields by their short names). More than one is a ValueError."""
    asked: list[StructuredOutputsParams] = []
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            asked.append(StructuredOutputsParams(json_object=True))
        elif kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise ValueError("response_format.json_schema needs a schema")
            asked.append(StructuredOutputsParams(json=schema))
        elif kind != "text":
            raise ValueError(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}"
            )
    if structured_outputs is not None:
        asked.append(StructuredOutputsParams.from_any(structured_outputs))
    given = {k: v for k, v in guided.items() if v is not None}
    if given:
        asked.append(StructuredOutputsParams(**given))
    if len(asked) > 1:
        raise ValueError(
            "ask for one structured output: response_format, structured_outputs or guided_*"
        )
    return asked[0] if asked else None
