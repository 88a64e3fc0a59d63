"""`compilecore serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the pair vLLM
uses) on `AsyncLLM`.

Routes: POST /v1/completions, /v1/chat/completions (both streaming as server-sent events
ending in `data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus), POST /tokenize,
/detokenize. Errors use OpenAI's error JSON: 400 for a bad field or a prompt longer than
the context (checked before anything is queued), 401 without the API key when one is set
(compared in constant time), 404 for another model name, 503 when the waiting queue is
full. An error after a stream has begun is an error event, then `data: [DONE]` (vLLM's
way). A client that disconnects mid-stream aborts its request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.async_engine import AsyncLLM, QueueFullError, RequestFailedError, StreamDelta
from runtime.entrypoints import tool_calls
from runtime.entrypoints.metrics import ServerMetrics
from runtime.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from runtime.structured_output import StructuredOutputsParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error JSON."""
    kind = _ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is closed when the response ends, also when the
    client went away mid-stream: Starlette then stops iterating and leaves the generator
    to the garbage collector, and the request it serves would run on to max_tokens."""

    def __init__(self, events: AsyncGenerator[str, None]):
        super().__init__(events, media_type="text/event-stream")

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # Shielded: a disconnect cancels this task's scope, which would cancel the
            # close itself at its first await.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def event_stream(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """`events`, and where they fail after the response has begun, vLLM's ending: an
    error event in OpenAI's error JSON, then `[DONE]` (a dropped connection tells the
    client nothing). Closing this closes `events`."""
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except APIError as e:
            yield _sse(error_body(e.status, e.message, e.param))
            yield "data: [DONE]\n\n"
        except Exception as e:  # a bug of ours: still a well-formed end
            yield _sse(error_body(500, f"{type(e).__name__}: {e}"))
            yield "data: [DONE]\n\n"


def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    chat_template: str | None = None,
    disable_any_whitespace: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """`chat_template`: the server's default (vLLM's `--chat-template`); a request's own
    `chat_template` still wins. `disable_any_whitespace`: structured JSON outputs without
    free whitespace (vLLM's `--structured-outputs-config` option of that name)."""
    app = FastAPI(title="compilecore", docs_url=None, redoc_url=None)
    if tool_call_parser not in (None, *tool_calls.PARSERS):
        raise ValueError(f"tool call parser {tool_call_parser!r}: one of {tool_calls.PARSERS}")
    server = _Server(
        engine, served_model_name, chat_template, disable_any_whitespace, tool_call_parser
    )
    protected = ("/v1/", "/tokenize", "/detokenize")

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith(protected):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                server.metrics.count("401")
                return error_response(401, "missing or wrong API key (Authorization: Bearer)")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        server.metrics.count("400")
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        server.metrics.count(str(exc.status))
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own refusals (a body that is not JSON, an unknown route) in OpenAI's
        # error JSON, like ours, instead of {"detail": ...}.
        server.metrics.count(str(exc.status_code))
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        server.metrics.count("500")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(engine.stats()))

    @app.get("/v1/models")
    async def models():
        card = {
            "id": served_model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "compilecore",
            "max_model_len": server.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if body.messages is not None:
            ids = server.chat_prompt(body.messages, True, False, None, None)["prompt_token_ids"]
        else:
            tok = engine.llm.tokenizer
            ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        return {"prompt": engine.llm.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await server.completions(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await server.chat(body)

    return app


class _Server:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        chat_template: str | None,
        disable_any_whitespace: bool = False,
        tool_parser: str | None = None,
    ):
        self.engine, self.model_name = engine, served_model_name
        self.chat_template = chat_template
        self.created = int(time.time())
        self.max_model_len = engine.llm.engine_config.model_config.max_model_len
        self.metrics = ServerMetrics()
        self.metrics.model_name = served_model_name
        self.disable_any_whitespace = disable_any_whitespace
        self.tool_parser = tool_parser  # "auto" tool choice parses calls with it

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
            )

    def chat_prompt(
        self, messages, add_generation_prompt, continue_final, template, kwargs, tools=None
    ):
        try:
            return self.engine.llm.apply_chat_template(
                [m.text() for m in messages],
                add_generation_prompt,
                chat_template=template,
                continue_final_message=continue_final,
                chat_template_kwargs=kwargs,
                tools=tools,
            )
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e

    def start(
        self, prompts: list[Any], params, prefix: str, max_tokens: int | None
    ) -> tuple[list, list[int]]:
        """Queue every prompt, all tokenized and checked first (a bad one queues nothing);
        the delta streams and the prompts' token counts. `max_tokens` is what the client
        asked for: like vLLM's server, more than the context leaves is a 400, not a cut."""
        if not prompts:
            raise APIError(400, "please provide at least one prompt", "prompt")
        added: list[str] = []
        try:
            ids = [self.engine.prepare(p, params) for p in prompts]
            for t in ids:
                self.check_room(len(t), max_tokens)
            streams = []
            for i, t in enumerate(ids):
                streams.append(self.engine.add(t, params, f"{prefix}-{i}"))
                added.append(f"{prefix}-{i}")
            return streams, ids
        except (ValueError, TypeError, QueueFullError) as e:
            for request_id in added:  # the queue filled up half-way: take back what went in
                self.engine.abort(request_id)
            raise APIError(503 if isinstance(e, QueueFullError) else 400, str(e)) from e

    def check_room(self, prompt_tokens: int, max_tokens: int | None) -> None:
        if max_tokens is not None and prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {self.max_model_len} tokens and your "
                f"request has {prompt_tokens} input tokens ({max_tokens} > "
                f"{self.max_model_len} - {prompt_tokens})",
                "max_tokens",
            )

    # -- /v1/completions ------------------------------------------------------------------
    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        # lm-eval's loglikelihood: echo the prompt with its logprobs and generate nothing.
        echo_only = body.echo and body.max_tokens == 0
        max_tokens = 1 if echo_only else body.max_tokens
        params = self._params(body, max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:
            params.prompt_logprobs = body.logprobs
        rid, kind = f"cmpl-{uuid.uuid4().hex}", "text_completion"
        streams, ids = self.start(prompts, params, rid, max_tokens)
        lengths, n, tokenizer = [len(t) for t in ids], params.n, self.engine.llm.tokenizer
        texts = {
            i: p if isinstance(p, str) else tokenizer.decode(ids[i]) for i, p in enumerate(prompts)
        }

        def choice(k: int, d: StreamDelta, text: str, i: int) -> dict:
            entries = [] if echo_only else d.logprobs
            if body.echo and d.prompt_logprobs:
                first = tokenizer.decode(ids[i][:1])
                entries = [first if e is None else e for e in d.prompt_logprobs] + entries
            lp = _completion_logprobs(entries, 0) if params.logprobs is not None else None
            return {
                "index": k,
                "text": texts[i] if echo_only else text,
                "logprobs": lp,
                "finish_reason": "length" if echo_only else d.finish_reason,
                "stop_reason": None if echo_only else d.stop_reason,
            }

        if body.stream:

            async def events():
                usage = {"prompt_tokens": sum(lengths), "completion_tokens": 0}
                echoed: set[tuple[int, int]] = set()
                async with aclosing(self._merged(streams)) as merged:
                    async for i, d in merged:
                        if echo_only and (i, d.index) in echoed:
                            continue  # the prompt went out with the first delta
                        usage["completion_tokens"] += 0 if echo_only else len(d.token_ids)
                        first = (i, d.index) not in echoed
                        echoed.add((i, d.index))
                        text = (texts[i] if body.echo and first else "") + d.text
                        chunk = choice(i * n + d.index, d, text, i)
                        yield _sse(self._envelope(rid, kind, [chunk]))
                for tail in self._stream_end(rid, kind, body, usage):
                    yield tail

            return EventStreamResponse(event_stream(events()))
        merged = await self._collect(streams)
        choices, completion_tokens = [], 0
        for (i, k), d in sorted(merged.items()):
            completion_tokens += 0 if echo_only else len(d.token_ids)
            text = (texts[i] if body.echo else "") + d.text
            choices.append(choice(i * n + k, d, text, i))
        usage = {"prompt_tokens": sum(lengths), "completion_tokens": completion_tokens}
        return self._envelope(rid, kind, choices, usage)

    # -- /v1/chat/completions -------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest):
        self.check_model(body.model)
        try:
            tool_choice = tool_calls.resolve_choice(body.tools, body.tool_choice, self.tool_parser)
            parallel = body.parallel_tool_calls is not False
            schema = tool_calls.forced_schema(body.tools, tool_choice, parallel)
        except ValueError as e:
            raise APIError(400, str(e), "tool_choice") from e
        prompt = self.chat_prompt(
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template or self.chat_template,
            body.chat_template_kwargs,
            body.tools,
        )
        max_tokens = body.max_completion_tokens or body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, max_tokens, top)
        if schema is not None:  # a required or named tool call, forced by the grammar
            if params.structured_outputs is not None:
                raise APIError(400, "tool_choice and a structured output exclude each other",
                               "tool_choice")  # fmt: skip
            params.structured_outputs = StructuredOutputsParams(
                json=schema, disable_any_whitespace=self.disable_any_whitespace
            )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams, (prompt_ids,) = self.start([prompt], params, rid, max_tokens)
        prompt_tokens = len(prompt_ids)

        def logprobs(d: StreamDelta) -> dict | None:
            return _chat_logprobs(d.logprobs, top) if top is not None else None

        if body.stream:
            events = self._chat_events(rid, body, streams, prompt_tokens, tool_choice, logprobs)
            return EventStreamResponse(event_stream(events))
        merged = await self._collect(streams)
        choices, completion_tokens = [], 0
        for (_, k), d in sorted(merged.items()):
            completion_tokens += len(d.token_ids)
            message, finish = _chat_message(d, tool_choice)
            choices.append({"index": k, "message": message, "logprobs": logprobs(d),
                            "finish_reason": finish, "stop_reason": d.stop_reason})  # fmt: skip
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return self._envelope(rid, "chat.completion", choices, usage)

    async def _chat_events(self, rid, body, streams, prompt_tokens, tool_choice, logprobs):
        """Chat chunks as tokens arrive; with tools in play, each choice's text is held
        until it ends and sent as content or as tool calls (what it is is known then)."""
        kind, usage = "chat.completion.chunk", {"prompt_tokens": prompt_tokens}
        usage["completion_tokens"] = 0
        started: set[int] = set()
        held: dict[int, StreamDelta] = {}
        async with aclosing(self._merged(streams)) as merged:
            async for _, d in merged:
                usage["completion_tokens"] += len(d.token_ids)
                delta: dict[str, Any] = {"content": d.text}
                finish = d.finish_reason
                if tool_choice is not None:
                    whole = held.setdefault(d.index, StreamDelta(d.index, "", [], []))
                    whole.text += d.text
                    delta = {"content": ""}
                    if finish is not None:
                        whole.finish_reason = finish
                        message, finish = _chat_message(whole, tool_choice)
                        delta = {k: v for k, v in message.items() if k != "role"}
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [
                                {"index": j, **call} for j, call in enumerate(delta["tool_calls"])
                            ]  # fmt: skip
                if d.index not in started:
                    started.add(d.index)
                    delta["role"] = "assistant"
                choice = {"index": d.index, "delta": delta, "logprobs": logprobs(d),
                          "finish_reason": finish}  # fmt: skip
                yield _sse(self._envelope(rid, kind, [choice]))
        for tail in self._stream_end(rid, kind, body, usage):
            yield tail

    # -- shared ---------------------------------------------------------------------------
    def _envelope(self, rid: str, kind: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": rid, "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": choices}  # fmt: skip
        if usage is not None:
            body["usage"] = _usage(usage)
        return body

    def _stream_end(self, rid: str, kind: str, body, usage: dict) -> list[str]:
        """The usage chunk (when `stream_options.include_usage`) and `[DONE]`."""
        end = []
        if body.stream_options and body.stream_options.include_usage:
            end.append(_sse(self._envelope(rid, kind, [], usage)))
        return end + ["data: [DONE]\n\n"]

    def _params(self, body, max_tokens: int | None, logprobs: int | None):
        defaults = self.engine.llm.get_default_sampling_params()
        try:
            params = body.sampling_params(defaults, max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(" ", 1)[0]) from e
        if self.disable_any_whitespace and params.structured_outputs is not None:
            params.structured_outputs.disable_any_whitespace = True
        return params

    async def _merged(self, streams: list) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Deltas of every prompt's stream as they come, with the prompt's index; the
        requests are aborted when the client goes away (or anything else ends this)."""
        queue: asyncio.Queue = asyncio.Queue()
        start = time.perf_counter()
        last: dict[int, float] = {}

        async def pump(i: int, stream) -> None:
            try:
                async for delta in stream:
                    await queue.put((i, delta))
            except RequestFailedError as e:
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        open_streams = len(tasks)
        status = "200"
        try:
            while open_streams:
                i, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, RequestFailedError):
                    status = "500"
                    raise APIError(500, str(item))
                now = time.perf_counter()
                if item.token_ids:
                    self.metrics.observe_token(now - last.get(i, start), first=i not in last)
                    last[i] = now
                yield i, item
        except (asyncio.CancelledError, GeneratorExit):
            status = "disconnected"
            raise
        finally:
            self.metrics.count(status)
            for task in tasks:
                task.cancel()
            # Shielded: after a disconnect this runs in a cancelled scope, where any await
            # would be cancelled before the requests were aborted. A pump cancelled inside
            # its stream closes that stream (which aborts the request); only then can a
            # stream that never started be closed here (closing one that a task is still
            # inside raises).
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
                for s in streams:
                    await s.aclose()

    async def _collect(self, streams: list) -> dict[tuple[int, int], StreamDelta]:
        out: dict[tuple[int, int], StreamDelta] = {}
        async for i, d in self._merged(streams):
            prev = out.get((i, d.index))
            if prev is None:
                out[(i, d.index)] = StreamDelta(
                    d.index,
                    d.text,
                    list(d.token_ids),
                    list(d.logprobs),
                    d.finish_reason,
                    d.stop_reason,
                    d.prompt_logprobs,
                )
            else:
                prev.text += d.text
                prev.token_ids += d.token_ids
                prev.logprobs += d.logprobs
                prev.finish_reason, prev.stop_reason = d.finish_reason, d.stop_reason
        return out


def _chat_message(d: StreamDelta, tool_choice: Any) -> tuple[dict, str | None]:
    """A finished choice's message (content, or tool calls) and its finish reason."""
    content, calls = tool_calls.parse(d.text, tool_choice)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        return message, d.finish_reason
    message["tool_calls"] = calls
    return message, "tool_calls" if d.finish_reason == "stop" else d.finish_reason


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("compilecore")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(u: dict) -> dict:
    return {**u, "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _completion_logprobs(entries: list, offset: int) -> dict:
    """OpenAI's completion logprobs; an entry that is text is a token nothing predicted
    (an echoed prompt's first): its logprob and top logprobs are null."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        if isinstance(entry, str):
            tokens.append(entry)
            token_logprobs.append(None)
            top.append(None)
            offsets.append(offset)
            offset += len(entry)
            continue
        chosen = next(iter(entry.values()))  # the sampled token comes first
        tokens.append(chosen.decoded_token or "")
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(entries: list, top_n: int) -> dict:
    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for entry in entries:
        values = list(entry.values())
        ranked = sorted(values, key=lambda lp: lp.rank or 0)[:top_n]
        content.append({**item(values[0]), "top_logprobs": [item(lp) for lp in ranked]})
    return {"content": content}
