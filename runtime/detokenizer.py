"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level BPE: one character (an emoji, a CJK
character) can span several tokens, and a token's text can depend on the one before it.
So the detokenizer decodes a short window of recent tokens twice, with and without the
new ones, and emits the difference once it no longer ends in an incomplete character.

Without stop strings nothing needs the text per token: `append` only records the id and the text
catches up when read (`text`), so offline generation decodes once per request instead of twice
per token (~40 us of a ~7 ms batch-1 step, docs/kernel-choices.md, Host time), and a stream that
reads every step decodes exactly as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# Prompt tokens kept as left context, so the first output token decodes with its spacing.
_CONTEXT_TOKENS = 5


def decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text as `tokenizer.decode` gives it. For a fast tokenizer without clean-up
    that is the Rust tokenizer's own `decode`, called directly: transformers' wrapper
    around it cost more than the decode (3.6 vs 1.6 us for a 6-token window here), and
    every token decodes two windows."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if callable(getattr(backend, "decode", None)) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = decoder(tokenizer, skip_special_tokens)
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._text = ""

    @property
    def text(self) -> str:
        if self.read_offset < len(self.ids):  # tokens not decoded yet (no stop strings)
            self._catch_up(check_stop=False)
        return self._text

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add a token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        if not self.stop:
            return None  # decoded when the text is read
        return self._catch_up(check_stop)

    def flush(self, check_stop: bool = True) -> str | None:
        """At the end of generation: emit what was held back (an incomplete character
        decodes to U+FFFD, as a full decode would show it)."""
        return self._catch_up(check_stop, final=True)

    def _catch_up(self, check_stop: bool, final: bool = False) -> str | None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return None  # nothing yet, or an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._extend(full[len(prefix) :], check_stop) if len(full) > len(prefix) else None

    def _extend(self, delta: str, check_stop: bool) -> str | None:
        start = len(self._text)
        self._text += delta
        if not check_stop:
            return None
        found = None
        for stop in self.stop:
            # A stop string may straddle the previous text and the new delta.
            idx = self._text.find(stop, max(0, start - len(stop) + 1))
            if idx != -1 and (found is None or idx < found[0]):
                found = (idx, stop)
        if found is None:
            return None
        idx, stop = found
        self._text = self._text[: idx + len(stop)] if self.include_stop else self._text[:idx]
        return stop


class NullDetokenizer:
    """For an engine without a tokenizer (`LLM(skip_tokenizer_init=True)`) or a request with
    `detokenize=False`: no text, so no stop strings either (both are refused earlier)."""

    text = ""

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        return None

    def flush(self, check_stop: bool = True) -> str | None:
        return None
