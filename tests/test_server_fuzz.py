"""The server under generated request bodies (hypothesis): wrong types, nulls, huge and
negative numbers, unknown fields, empty and oversized prompts, broken UTF-8, streaming on
and off. Every answer is a 2xx whose body has the OpenAI response's shape, or a 4xx in
OpenAI's error JSON: never a 5xx, a dropped connection or a dead server; afterwards the
engine holds no request and no KV block, and a greedy request answers as before."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from runtime import LLM, SamplingParams
from runtime.async_engine import AsyncLLM
from runtime.entrypoints.openai_server import build_app
from tests.test_benchmarks import _load
from tests.test_server import KEY, MODEL, _http, _idle, _serving

AUTH = {"Authorization": f"Bearer {KEY}"}
FINISH_REASONS = {"stop", "length", "error"}

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-5, 400), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3) | st.text(max_size=3), max_size=2),
)


TOKEN = st.integers(0, 319)
SAMPLING = {
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 4),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-200, 200), max_size=3),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(TOKEN, max_size=3),
    "allowed_token_ids": st.lists(TOKEN, max_size=3),
    "bad_words": st.lists(st.text(max_size=4), max_size=2),
    "truncate_prompt_tokens": st.integers(-1, 80),
    "skip_special_tokens": st.booleans(),
    "user": st.text(max_size=5),
}
PROMPT = st.one_of(
    st.text(max_size=40),
    st.just(""),
    st.just("word " * 200),  # longer than the context
    st.lists(st.integers(-3, 330), max_size=8),
    st.lists(st.text(max_size=10), max_size=3),
    st.lists(st.lists(TOKEN, max_size=5), max_size=3),
)
CONTENT = st.one_of(
    st.text(max_size=30),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})),
    st.lists(st.dictionaries(st.sampled_from(["type", "text", "x"]), JUNK), max_size=2),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
    optional={"content": CONTENT, "name": st.text(max_size=5)},
)
COMPLETION = (
    {"model": st.just(MODEL), "prompt": PROMPT, "max_tokens": st.integers(1, 6)},
    {**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()},
)
CHAT = (
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3),
     "max_tokens": st.integers(1, 6)},
    {**SAMPLING, "max_completion_tokens": st.integers(1, 6), "logprobs": st.booleans(),
     "top_logprobs": st.integers(0, 5),
     "chat_template": st.sampled_from(["{{ messages[0].content }}x", "{% for", "{{ 1 / 0 }}"]),
     "chat_template_kwargs": st.dictionaries(st.sampled_from(["messages", "tools", "k"]), JUNK),
     "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans()},
)  # fmt: skip


RARELY = st.sampled_from([False] * 9 + [True])  # hypothesis favours a range's low end


@st.composite
def bodies(draw, fields: tuple[dict, dict]):
    """A valid body with a few of the optional fields, then up to three fields (known or
    not, required or not) set to junk or removed; or, now and then, junk instead of a body."""
    required, optional = fields
    if draw(RARELY):
        return draw(JUNK)
    body = draw(st.fixed_dictionaries(required, optional=optional))
    names = sorted({*required, *optional, "an_unknown_field"})
    for _ in range(draw(st.integers(0, 3) | st.just(0))):
        name = draw(st.sampled_from(names))
        if draw(st.integers(0, 3)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(JUNK)
    return body


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    llm = LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=64, max_num_seqs=16)
    engine = AsyncLLM(llm, max_waiting=32)
    with _serving(build_app(engine, MODEL, api_key=KEY)) as base:
        yield base, engine
    engine.shutdown()


def _encode(body: dict, corrupt: bool) -> bytes:
    data = json.dumps(body).encode()  # nan and inf as JSON's common extension does
    return data.replace(b'"', b'"\xff\xfe', 1) if corrupt else data  # broken UTF-8


def _check_error(status: int, payload: dict) -> None:
    error = payload["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)


def _check_choice(choice: dict, chat: bool, chunk: bool) -> None:
    assert isinstance(choice["index"], int)
    assert choice["finish_reason"] in FINISH_REASONS | ({None} if chunk else set())
    if chat:
        message = choice["delta" if chunk else "message"]
        assert isinstance(message.get("content", ""), str)
    else:
        assert isinstance(choice["text"], str)


def _check_ok(r, chat: bool, stream: bool) -> None:
    if not stream:
        payload = r.json()
        assert payload["object"] == ("chat.completion" if chat else "text_completion")
        assert payload["model"] == MODEL and payload["choices"]
        for choice in payload["choices"]:
            _check_choice(choice, chat, chunk=False)
        usage = payload["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        return
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-300:]
    for event in events[:-1]:
        payload = json.loads(event)
        assert "error" not in payload, payload  # an internal error mid-stream
        for choice in payload["choices"]:
            _check_choice(choice, chat, chunk=True)


def _post(base: str, route: str, body, corrupt: bool) -> None:
    chat = route == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = _http("POST", base + path, _encode(body, corrupt), AUTH)
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400:
        _check_error(r.status_code, r.json())
    else:
        assert r.status_code == 200
        _check_ok(r, chat, stream=isinstance(body, dict) and body.get("stream") is True)


SLOW_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=SLOW_CHECKS)


@pytest.mark.slow
@FUZZ
@given(body=bodies(COMPLETION), corrupt=RARELY)
@example(body={"prompt": "x", "n": 2**40}, corrupt=False)  # more than the queue: a 400, not 503
@example(body={"prompt": "x", "stream": True, "temperature": float("nan")}, corrupt=False)
@example(body={"prompt": "x", "max_tokens": 5}, corrupt=True)
def test_fuzzed_completions(fuzz_server, body, corrupt):
    _post(fuzz_server[0], "completions", body, corrupt)


@pytest.mark.slow
@FUZZ
@given(body=bodies(CHAT), corrupt=RARELY)
def test_fuzzed_chat_completions(fuzz_server, body, corrupt):
    _post(fuzz_server[0], "chat", body, corrupt)


@pytest.mark.slow
def test_faults_under_load(fuzz_server):
    """benchmarks/soak_server.py's load, short: 24 streaming clients x 3 requests, a third
    going away mid-stream, a tenth sending bad requests, more at once than the queue's 4
    places. Nothing fails; afterwards nothing runs or holds a KV block, /health answers,
    /metrics counted the streams and refusals, and greedy text is unchanged."""
    base, engine = fuzz_server
    soak = _load("soak_server")
    engine.max_waiting = 4
    try:
        load = {"clients": 24, "rounds": 3, "max_tokens": 12, "max_words": 4, "duration": 120}
        result = asyncio.run(soak.soak(base, MODEL, seed=3, api_key=KEY, **load))
    finally:
        engine.max_waiting = 32
    assert soak.passed(result), json.dumps(result, indent=1)
    counted = result["after"]["metrics_counted"]
    assert result["bad_refused"] and counted["400"] >= result["bad_refused"]
    assert result["queue_full"] and counted["503"] >= result["queue_full"]
    assert result["disconnected"] and result["completed"]
    _idle(engine)


def test_after_the_fuzz_the_server_is_whole(fuzz_server, tiny_llama):
    """Runs after the fuzz tests (file order): nothing left running, every block free,
    /health answers, and a greedy request gives the offline LLM's text."""
    base, engine = fuzz_server
    _idle(engine)
    assert _http("GET", base + "/health").status_code == 200
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    got = _http("POST", base + "/v1/completions", body, AUTH).json()["choices"][0]["text"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=64)
    assert got == offline.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].text
