"""Incremental detokenization: multi-byte characters and stop strings across tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from runtime.detokenizer import IncrementalDetokenizer

TEXTS = ["héllo wörld 🙂🚀 日本語", "naïve café — déjà vu", "plain ascii text here", "🙂🙂🙂a🙂"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _stream(tok, prompt_ids, ids, read_every_token=False, **kwargs):
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    stop, seen = None, ""
    for t in ids:
        stop = detok.append(t)
        if stop:
            break
        if read_every_token:  # a stream: until a stop string cuts it, the text only grows
            assert detok.text.startswith(seen)
            seen = detok.text
    else:
        detok.flush()
    return detok.text, stop


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    streamed, _ = _stream(tokenizer, tokenizer.encode("prompt: "), ids)
    assert streamed == tokenizer.decode(ids)


def test_some_tokens_are_partial_characters(tokenizer):
    # Otherwise the tests above would not exercise the held-back path.
    ids = tokenizer.encode(TEXTS[0])
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(3, 319), min_size=1, max_size=30), read=st.booleans())
def test_any_token_sequence_streams_to_its_full_decode(tokenizer, ids, read):
    """Read once at the end (decoded then, in one window) or after every token (a
    stream): the same text, the full decode's."""
    streamed, _ = _stream(tokenizer, [5, 6, 7], ids, read_every_token=read)
    assert streamed == tokenizer.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_text_read_mid_stream_then_at_the_end(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids[: len(ids) // 2]:
        detok.append(t)
    half = detok.text  # decodes the pending tokens in one window
    for t in ids[len(ids) // 2 :]:
        detok.append(t)
    detok.flush()
    assert detok.text.startswith(half) and detok.text == tokenizer.decode(ids)


def test_stop_string_across_token_boundaries(tokenizer):
    text = "naïve café — déjà vu"
    ids = tokenizer.encode(text)
    out, stop = _stream(tokenizer, [], ids, read_every_token=True, stop=["é —", "zzz"])
    assert stop == "é —" and out == "naïve caf"


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("one two three")
    out, stop = _stream(tokenizer, [], ids, stop=["three", "two"])
    assert stop == "two" and out == "one "


def test_real_default_tokenizer_multibyte(default_model_dir):
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert _stream(tok, [], ids)[0] == tok.decode(ids)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=12), skip=st.booleans())
def test_decoder_equals_the_tokenizers_decode(tokenizer, ids, skip):
    """The detokenizer's decode (the Rust tokenizer's, called directly when transformers
    would add nothing) gives `tokenizer.decode`'s text, special tokens included; with
    clean-up on it is transformers' decode itself."""
    from runtime.detokenizer import decoder

    ids = ids + tokenizer.all_special_ids[:2]
    assert decoder(tokenizer, skip)(ids) == tokenizer.decode(ids, skip_special_tokens=skip)
    cleaned = AutoTokenizer.from_pretrained(tokenizer.name_or_path,
                                            clean_up_tokenization_spaces=True)  # fmt: skip
    assert decoder(cleaned, skip).func == cleaned.decode
