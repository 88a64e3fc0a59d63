"""The OpenAI-compatible server, started in this process on a free loopback port and
talked to with the official `openai` client (and raw HTTP where the client hides what is
tested). The oracle for generated text is the offline `LLM` on the same checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import threading
import time
from urllib.parse import urlparse

import jsonschema
import openai
import pytest
import uvicorn

from runtime import LLM, SamplingParams
from runtime.async_engine import AsyncLLM
from runtime.entrypoints.openai_server import build_app
from tests.test_structured_outputs import SCHEMAS

KEY = "test-key"
MODEL = "tiny"
PROMPTS = [f"The {w} brown fox" for w in ("quick", "slow", "red", "old")] + ["Compilers are"]


class _ThreadServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # runs in a thread, not the main one
        pass


class _Response:
    def __init__(self, status: int, body: bytes):
        self.status_code, self.content = status, body

    def json(self):
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode()


def _http(method: str, url: str, body=None, headers=None) -> _Response:
    """Plain HTTP (what a client that is not the openai package sends)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, u.path, body=data, headers=hdrs)
    r = conn.getresponse()
    out = _Response(r.status, r.read())
    conn.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    return LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=256)


@contextlib.contextmanager
def _serving(app):
    """The app on a free loopback port, in a thread; yields its base URL."""
    port = _free_port()
    srv = _ThreadServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = LLM(str(tiny_llama[0]), enforce_eager=True, max_model_len=256, max_num_seqs=48)
    engine = AsyncLLM(llm, max_waiting=64)
    # No free whitespace in structured JSON: the random model pads with it otherwise.
    with _serving(build_app(engine, MODEL, api_key=KEY, disable_any_whitespace=True)) as base:
        yield base, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _greedy_text(oracle: LLM, prompt, max_tokens: int = 12) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return oracle.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def _idle(engine: AsyncLLM, timeout: float = 10.0) -> None:
    bm = engine.engine.scheduler.block_manager
    deadline = time.time() + timeout
    while time.time() < deadline:
        with engine.lock:
            idle = not engine.inbox and not engine.engine.has_unfinished_requests()
            if idle and bm.num_free_blocks == bm.num_blocks:
                return
        time.sleep(0.05)
    raise AssertionError("the engine still holds requests or KV blocks")


GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_completion_and_usage(client, oracle):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
    assert out.choices[0].text == _greedy_text(oracle, PROMPTS[0])
    assert out.choices[0].finish_reason == "length"
    prompt_tokens = len(oracle.get_tokenizer().encode(PROMPTS[0]))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 12)
    assert out.usage.total_tokens == prompt_tokens + 12


def test_chat_completion(client, oracle):
    messages = [{"role": "user", "content": "Say something."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    prompt = oracle.apply_chat_template(messages)
    assert out.choices[0].message.content == _greedy_text(oracle, prompt)
    assert out.choices[0].message.role == "assistant"


def test_streaming_joins_to_the_same_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], **GREEDY)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True},
        **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    messages = [{"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    parts = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in parts)
    assert text == full.choices[0].message.content


def test_n_stop_and_logprobs(client, oracle):
    two = client.completions.create(model=MODEL, prompt=PROMPTS[2], n=2, temperature=1.0,
                                    seed=3, max_tokens=6)  # fmt: skip
    assert sorted(c.index for c in two.choices) == [0, 1]
    text = _greedy_text(oracle, PROMPTS[2])
    stop = text[3:6]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], stop=[stop], **GREEDY)
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    lp = client.completions.create(model=MODEL, prompt=PROMPTS[2], logprobs=2, **GREEDY)
    info = lp.choices[0].logprobs
    assert len(info.token_logprobs) == 12 and all(v <= 0 for v in info.token_logprobs)
    assert all(len(top) >= 2 for top in info.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          logprobs=True, top_logprobs=2, **GREEDY)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 2 for c in content)


def test_vllm_extra_fields_truncate_and_restrict_tokens(client, oracle):
    """vLLM's extra body fields reach the sampler as they do offline."""
    long = list(range(10, 300))  # over max_model_len=256
    out = client.completions.create(model=MODEL, prompt=long, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 40}})  # fmt: skip
    assert out.usage.prompt_tokens == 40
    assert out.choices[0].text == _greedy_text(oracle, {"prompt_token_ids": long[-40:]})
    only = {"ignore_eos": True, "allowed_token_ids": [7, 9], "bad_words": ["x"],
            "spaces_between_special_tokens": False}  # fmt: skip
    restricted = client.completions.create(model=MODEL, prompt=PROMPTS[3], logprobs=0, **{
        **GREEDY, "extra_body": only})  # fmt: skip
    tokenizer = oracle.get_tokenizer()
    allowed = {tokenizer.decode([7]), tokenizer.decode([9])}
    assert set(restricted.choices[0].logprobs.tokens) <= allowed


def test_32_concurrent_streams_equal_sequential_greedy(server, oracle):
    base, engine = server
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    want = [_greedy_text(oracle, p) for p in prompts]

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(run()) == want
    _idle(engine)


@pytest.mark.parametrize("prompts", [1, 2], ids=["one-prompt", "two-prompts"])
def test_disconnect_mid_stream_frees_the_request(server, prompts):
    """One prompt's stream or several merged: the requests are aborted when the client
    goes away (counted as such), not run on to max_tokens."""
    base, engine = server
    disconnected = _counted(base, "disconnected")
    prompt = PROMPTS[3] if prompts == 1 else [PROMPTS[3], PROMPTS[2]]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 240, "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={**headers, "Content-Type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    line = r.fp.readline()
    while not line.startswith(b"data: "):
        line = r.fp.readline()
    assert json.loads(line[6:])["choices"]
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    _idle(engine)  # the abort freed every block
    assert _counted(base, "disconnected") == disconnected + 1


def _counted(base: str, status: str) -> float:
    text = _http("GET", base + "/metrics").text
    line = f'compilecore:requests_total{{status="{status}"}} '
    return next((float(ln[len(line) :]) for ln in text.splitlines() if ln.startswith(line)), 0.0)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_error_mid_stream_ends_with_an_error_event_and_done(server, client, monkeypatch, route):
    """A step that fails after the stream began (injected: the real executor raises at its
    third call) ends the stream as vLLM's server does, an error event in OpenAI's error
    JSON and then `[DONE]`, instead of a dropped connection; the engine serves on."""
    base, engine = server
    executor = engine.engine.executor
    real, calls = executor.execute, []

    def failing_third_step(plan):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real(plan)

    monkeypatch.setattr(executor, "execute", failing_third_step)
    body = {"model": MODEL, "max_tokens": 20, "stream": True, "ignore_eos": True}
    if route == "chat":
        messages = [{"role": "user", "content": "x"}]
        path, body = "/v1/chat/completions", {**body, "messages": messages}
    else:
        path, body = "/v1/completions", {**body, "prompt": PROMPTS[0]}
    r = _http("POST", base + path, body, {"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "injected fault" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2]) and len(events) >= 4
    monkeypatch.undo()
    _idle(engine)
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "word " * 400}, 400, None),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": []}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1, 2], []], "max_tokens": 2}, 400, None),
        # vLLM's server refuses more new tokens than the context leaves (max_model_len 256)
        ({"model": MODEL, "prompt": "x", "max_tokens": 256}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 300}, 400, None),
        (
            {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0},
            400,
            "truncate_prompt_tokens",
        ),  # fmt: skip
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        # No field dropped in silence: one not served is a 400 naming it
        ({"model": MODEL, "prompt": "x", "suffix": "!"}, 400, "suffix"),
        ({"model": MODEL, "prompt": "x", "temprature": 0.5}, 400, "temprature"),
        # vLLM: stream_options only with stream=true
        (
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),  # fmt: skip
        # EOS (id 2) is the only token allowed and min_tokens masks it: nothing to draw
        ({"model": MODEL, "prompt": "x", "allowed_token_ids": [2], "min_tokens": 1}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body,
                                                                     status, param):  # fmt: skip
    base, engine = server
    r = _http("POST", base + "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    if param:
        assert error["param"] == param
    _idle(engine)
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


def test_openai_nulls_are_the_defaults_and_top_logprobs_needs_logprobs(server):
    """OpenAI's spec allows null for n, stream, logprobs and the penalties (clients that
    serialize every field send them): null means the default, as in OpenAI's and vLLM's
    servers. top_logprobs without logprobs is a 400, as in vLLM."""
    base, engine = server
    auth = {"Authorization": f"Bearer {KEY}"}
    nulls = {"n": None, "stream": None, "logprobs": None, "presence_penalty": None,
             "frequency_penalty": None, "max_tokens": 3, "temperature": 0}  # fmt: skip
    r = _http("POST", base + "/v1/completions", {"model": MODEL, "prompt": "x", **nulls}, auth)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **nulls}
    assert _http("POST", base + "/v1/chat/completions", chat, auth).status_code == 200
    r = _http("POST", base + "/v1/chat/completions", {**chat, "top_logprobs": 2}, auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    _idle(engine)


def test_max_tokens_beyond_the_context_is_refused_like_vllm(server):
    """Exactly the room the prompt leaves runs; one token more is a 400 that names the
    numbers, for completions and chat (max_completion_tokens) alike."""
    base, engine = server
    auth = {"Authorization": f"Bearer {KEY}"}
    room = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 253, "temperature": 0}
    assert _http("POST", base + "/v1/completions", room, auth).status_code == 200
    r = _http("POST", base + "/v1/completions", {**room, "max_tokens": 254}, auth)
    assert r.status_code == 400
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    assert "has 3 input tokens (254 > 256 - 3)" in r.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 256}  # fmt: skip
    r = _http("POST", base + "/v1/chat/completions", chat, auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    _idle(engine)


def test_malformed_json_wrong_key_and_full_queue(server, client):
    base, engine = server
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = _http("POST", base + "/v1/completions", b"{not json", auth)
    assert r.status_code == 400
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    engine.max_waiting = 0
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        engine.max_waiting = 64
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


def test_requests_arrive_during_a_step_and_a_full_queue_takes_back_a_partial_batch(
    server, client, oracle
):
    """While the stepping thread holds the engine (a long step), the event loop still
    parses, queues and answers: adds and aborts go through the inbox. A batch of prompts
    that fills the queue half-way gets 503 and leaves nothing queued."""
    _, engine = server
    done: list = []
    with engine.lock:  # a step in flight, as far as the server can tell

        def request() -> None:
            try:
                client.completions.create(model=MODEL, prompt=["a"] * 65, max_tokens=2)
            except openai.InternalServerError as exc:
                done.append(exc.status_code)

        worker = threading.Thread(target=request)
        worker.start()
        worker.join(timeout=30)  # with the old lock, the event loop waited here forever
        assert done == [503]
        assert len(engine.inbox) == 2 * 64  # 64 adds, then 64 aborts taking them back
    _idle(engine)  # drained in order: nothing was admitted, every block is free
    assert engine.stats()["waiting"] == 0
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
    assert out.choices[0].text == _greedy_text(oracle, PROMPTS[0])


def test_models_health_metrics_tokenize(server, client, oracle):
    base, _ = server
    assert [m.id for m in client.models.list()] == [MODEL]
    assert _http("GET", base + "/health").status_code == 200
    text = _http("GET", base + "/metrics").text
    for name in (
        "compilecore:requests_total",
        "compilecore:time_to_first_token_seconds",
        "compilecore:kv_cache_usage_perc",
        "compilecore:num_requests_waiting",
    ):
        assert name in text
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = _http("POST", base + "/tokenize", {"prompt": "hello world"}, auth).json()
    assert ids["tokens"] == oracle.get_tokenizer().encode("hello world")
    back = _http("POST", base + "/detokenize", {"tokens": ids["tokens"]}, auth).json()
    assert back["prompt"] == "hello world"


def test_server_default_chat_template_and_a_requests_own(server, oracle):
    """vLLM's `--chat-template`: the server's default; a request's `chat_template` wins."""
    base, engine = server
    default = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    own = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    messages = [{"role": "user", "content": "hello there"}]
    with _serving(build_app(engine, MODEL, chat_template=default)) as other:
        body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 6,
                "ignore_eos": True}  # fmt: skip
        plain = _http("POST", other + "/v1/chat/completions", body).json()
        mine = _http("POST", other + "/v1/chat/completions", {**body, "chat_template": own})
    assert plain["choices"][0]["message"]["content"] == _greedy_text(oracle, "[hello there]", 6)
    assert mine.json()["choices"][0]["message"]["content"] == _greedy_text(
        oracle, "<hello there>", 6
    )
    _idle(engine)


SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["response_format", "structured_outputs"])
@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_json_schemas_through_the_server(client, schema, route, stream):
    """Each of the 20 schemas through OpenAI's response_format and vLLM's
    structured_outputs: every choice (n=2, sampled) parses and validates, whole or
    streamed."""
    spec = SCHEMAS[schema]
    if route == "response_format":
        extra = {"response_format": {"type": "json_schema",
                                     "json_schema": {"name": "s", "schema": spec}}}  # fmt: skip
    else:
        extra = {"structured_outputs": {"json": spec}}
    messages = [{"role": "user", "content": "Give me JSON"}]
    kwargs = dict(model=MODEL, messages=messages, n=2, max_tokens=80, temperature=1.0,
                  seed=schema, extra_body=extra)  # fmt: skip
    if not stream:
        texts = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    else:
        texts = ["", ""]
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), spec)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        # Any object: a random model's keys can run to max_tokens; what came is its start.
        ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
    ],
)
def test_vllm_structured_output_fields(client, extra, check):
    out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=60, temperature=0,
                                    extra_body=extra)  # fmt: skip
    choice = out.choices[0]
    assert check(choice.text), choice.text
    assert choice.finish_reason == "stop" or "response_format" in extra


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"guided_regex": "(unclosed"}, "does not compile"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "exactly one of"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "ask for one"),
    ],
)
def test_a_structured_output_that_cannot_be_served_is_a_400(server, extra, message):
    base, engine = server
    body = {"model": MODEL, "prompt": "x", **extra}
    r = _http("POST", base + "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    _idle(engine)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}},
    "required": ["utc"], "additionalProperties": False}}}  # fmt: skip


def _calls(client, tool_choice, stream: bool, messages=None) -> tuple[list, str]:
    messages = messages or [{"role": "user", "content": "Weather in Paris?"}]
    # One call at most: a random model would add calls until max_tokens.
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  max_tokens=80, temperature=0, parallel_tool_calls=False)  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.tool_calls or [], choice.finish_reason
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                calls[call.index] = call
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("named", [True, False], ids=["named", "required"])
def test_forced_tool_calls_round_trip(client, stream, named):
    """tool_choice "required" or a named function forces a valid call through the grammar
    (any model): the call's arguments validate against its tool, finish_reason is
    "tool_calls"; the call and a tool result go back through the template and the model
    answers in text."""
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
    calls, finish = _calls(client, choice, stream)
    assert calls and finish == "tool_calls"
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments),
                            tools[call.function.name]["function"]["parameters"])  # fmt: skip
    if named:
        assert [c.function.name for c in calls] == ["get_weather"]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": calls[0].function.name, "arguments": calls[0].function.arguments}}
        ]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C and sunny"},
    ]  # fmt: skip
    final = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                           temperature=0, tools=[WEATHER])  # fmt: skip
    assert final.choices[0].message.content is not None and not final.choices[0].message.tool_calls


def test_tools_and_tool_messages_reach_the_chat_template(oracle):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{{ m.role }}:{{ m.content }}{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.arguments.city }}{% endif %}"
                "{{ m.tool_call_id or '' }};{% endfor %}")  # fmt: skip
    from runtime.entrypoints.protocol import ChatMessage

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [ChatMessage(role="assistant", content=None, tool_calls=[call]),
                ChatMessage(role="tool", tool_call_id="call_1", content="cold")]  # fmt: skip
    prompt = oracle.apply_chat_template(
        [m.text() for m in messages], False, chat_template=template, tools=[WEATHER, TIME]
    )["prompt"]
    assert prompt == "[get_weather][get_time]assistant:Oslo;tool:coldcall_1;"


def test_tool_choice_errors_are_400s(server):
    base, engine = server
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, message in [
        ({"tools": [WEATHER], "tool_choice": "auto"}, "--enable-auto-tool-choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                              "function": {"name": "nope"}}}, "names no tool"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools must be"),
    ]:  # fmt: skip
        r = _http("POST", base + "/v1/chat/completions", {**chat, **extra}, auth)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    # Tools without a tool_choice and without a parser: plain text, as vLLM's "none".
    r = _http("POST", base + "/v1/chat/completions", {**chat, "tools": [WEATHER]}, auth)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] != "tool_calls"
    _idle(engine)


def test_auto_tool_choice_parses_hermes_calls():
    from runtime.entrypoints import tool_calls

    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text += "</tool_call>"
    content, calls = tool_calls.parse(text, "auto")
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert tool_calls.parse("no call here", "auto") == ("no call here", [])
    assert tool_calls.parse("<tool_call>{broken</tool_call>", "auto")[1] == []


def test_version_and_vllm_metric_names(server, client):
    base, _ = server
    assert _http("GET", base + "/version").json()["version"]
    client.completions.create(model=MODEL, prompt="ok", max_tokens=2)
    text = _http("GET", base + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_count"):  # fmt: skip
        assert name in text, name
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_returns_the_prompts_logprobs(client, oracle, max_tokens):
    """lm-eval's loglikelihood request (`echo`, `logprobs=1`, `max_tokens=0`): the prompt
    back with a logprob per token after the first (null for the first), equal to the
    offline LLM's prompt logprobs; with max_tokens > 0 the generated tokens' follow."""
    prompt = [5, 6, 7, 8, 9, 10]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                    echo=True, logprobs=1, temperature=0)  # fmt: skip
    choice = out.choices[0]
    want = oracle.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    expected = [next(iter(e.values())).logprob for e in want[0].prompt_logprobs[1:]]
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(prompt) + max_tokens
    assert got[1 : len(prompt)] == pytest.approx(expected, abs=1e-5)
    assert choice.text.startswith(oracle.tokenizer.decode(prompt))
    assert out.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert choice.text == oracle.tokenizer.decode(prompt)


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA", "FINAL_ONLY"])
def test_async_generate_yields_request_outputs_by_output_kind(server, oracle, kind):
    """vLLM's AsyncLLM.generate: RequestOutputs, everything so far (CUMULATIVE), only the
    new part (DELTA, which joins to the whole) or one at the end (FINAL_ONLY); n=2, the
    greedy text equal to the offline LLM's."""
    from runtime import RequestOutputKind

    _, engine = server
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2,
                            output_kind=RequestOutputKind[kind])  # fmt: skip

    async def collect():
        return [o async for o in engine.generate("The quick brown fox", params, f"gen-{kind}")]

    outs = asyncio.run(collect())
    want = _greedy_text(oracle, "The quick brown fox", 10)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    if kind == "FINAL_ONLY":
        assert len(outs) == 1
    if kind == "DELTA":
        for index in (0, 1):
            parts = [c for o in outs for c in o.outputs if c.index == index]
            assert "".join(c.text for c in parts) == want
            assert sum(len(c.token_ids) for c in parts) == 10
    else:
        assert [c.text for c in outs[-1].outputs] == [want, want]
        assert all(len(c.token_ids) == 10 for c in outs[-1].outputs)
    _idle(engine)


def test_auto_tool_choice_through_a_server_with_the_hermes_parser(server):
    """`--enable-auto-tool-choice --tool-call-parser hermes`: a Hermes <tool_call> block in
    the output becomes tool_calls (a regex makes this random model write one); text
    without one stays content."""
    _, engine = server
    with _serving(build_app(engine, MODEL, api_key=KEY, tool_call_parser="hermes")) as base:
        auto = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        out = auto.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], max_tokens=80, temperature=0,
            extra_body={"guided_regex": re.escape(call)},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
        plain = auto.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], max_tokens=5, temperature=0
        )
        assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    _idle(engine)
