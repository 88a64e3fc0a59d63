"""`AsyncLLM`: the engine for many concurrent clients (vLLM's `AsyncLLM` shape).

One background thread steps the engine while there is work; coroutines add requests and
receive output deltas as tokens arrive, through an asyncio queue per request. The engine
itself stays single-threaded: coroutines never call into it. An add or an abort is a
message on an inbox that the stepping thread drains before each step (vLLM's engine-core
input queue), so the event loop never waits for a step in flight: a 16-request prefill
step takes ~100 ms on a 2-core CPU, and an event loop blocked that long delays every
other client's tokens and every new request's parsing. After each step the stepping
thread hands each event loop all of that step's deltas in one callback.

    llm = LLM(...)                         # the offline LLM keeps working as before
    engine = AsyncLLM(llm)
    async for delta in engine.generate(prompt, params, "req-1"):
        ...                                # StreamDelta per step with new tokens/text
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from runtime.llm import LLM, PromptType
from runtime.outputs import CompletionOutput, Logprob, RequestOutput
from runtime.request import Request
from runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("compilecore")


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_waiting` allows (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The step that ran this request raised; the request was aborted."""


@dataclass
class StreamDelta:
    """What one sample (`index`) produced since the last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # On a sample's first delta, where its params ask for them: the prompt's logprobs
    # (None for the first prompt token, which nothing predicts).
    prompt_logprobs: list | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    children: list[Request]
    sent_tokens: list[int] = field(default_factory=list)
    sent_text: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    admitted: bool = False  # its requests are in the engine (the stepping thread sets it)


class AsyncLLM:
    """`AsyncLLM(llm)` steps an existing `LLM` from a background thread; `AsyncLLM(model,
    **engine_args)` builds the `LLM` on that thread, which is what a server should do:
    OpenMP keeps one worker team per thread that ever ran a parallel region, and with more busy
    teams than cores libgomp stops spinning at barriers and sleeps instead, which halves decode
    speed on a 2-core machine (docs/kernel-choices.md, The engine thread). Built on the stepping
    thread, the engine's kernels are the only team."""

    def __init__(
        self,
        llm: LLM | str | None = None,
        *,
        max_waiting: int = 256,
        **engine_args: Any,
    ):
        self.max_waiting = max_waiting
        self.lock = threading.Lock()  # held by the stepping thread around each step
        self.wake = threading.Event()
        # ("add" | "abort", request id, stream), in arrival order; deque appends and pops
        # are atomic, so producers need no lock.
        self.inbox: collections.deque = collections.deque()
        self._streams_lock = threading.Lock()  # guards streams and _queued, never a step
        self.streams: dict[str, _Stream] = {}
        self._queued = 0  # requests in the inbox, not yet in the scheduler's waiting queue
        self.stopped = False
        ready = threading.Event()
        failure: list[BaseException] = []

        def start() -> None:
            try:
                self.llm = llm if isinstance(llm, LLM) else LLM(llm, **engine_args)
                self.engine = self.llm.llm_engine
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                ready.set()
            self._loop()

        self.thread = threading.Thread(target=start, name="compilecore-engine", daemon=True)
        self.thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    # -- requests -------------------------------------------------------------------------
    def prepare(self, prompt: PromptType, params: SamplingParams) -> list[int]:
        """Validate and tokenize (raises ValueError/TypeError before anything is queued)."""
        tokens = self.llm._tokenize(0, prompt, params)
        self.llm._validate_params(0, params)
        return tokens

    async def generate(
        self, prompt: PromptType | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's `AsyncLLM.generate`: `RequestOutput`s as tokens arrive, as
        `params.output_kind` says (everything so far, only what is new, or one at the end).
        Cancelling the consumer aborts the request and frees its KV blocks; a failed step
        raises RequestFailedError here."""
        tokens = self.prepare(prompt, params)
        kind = params.output_kind
        outputs = [CompletionOutput(i, "", [], None, []) for i in range(params.n)]
        text = prompt if isinstance(prompt, str) else None
        async for d in self._iterate(request_id, self._add(request_id, tokens, params)):
            whole = outputs[d.index]
            whole.text += d.text
            whole.token_ids += d.token_ids
            whole.logprobs += d.logprobs
            whole.finish_reason, whole.stop_reason = d.finish_reason, d.stop_reason
            finished = all(o.finish_reason is not None for o in outputs)
            if kind is RequestOutputKind.FINAL_ONLY and not finished:
                continue
            if kind is RequestOutputKind.DELTA:
                new = CompletionOutput(d.index, d.text, list(d.token_ids), None,
                                       list(d.logprobs) or None, d.finish_reason,
                                       d.stop_reason)  # fmt: skip
                yield RequestOutput(request_id, text, tokens, [new], finished)
            else:
                yield RequestOutput(request_id, text, tokens, [_copy(o) for o in outputs], finished)

    def add(self, prompt: PromptType | list[int], params: SamplingParams, request_id: str):
        """Queue a request now (ValueError, TypeError or QueueFullError before anything
        is queued) and return its delta stream, to iterate from this event loop."""
        tokens = self.prepare(prompt, params)
        return self._iterate(request_id, self._add(request_id, tokens, params))

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[StreamDelta]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    return
                yield item
        finally:
            self.abort(request_id)

    def _add(self, request_id: str, tokens: list[int], params: SamplingParams) -> _Stream:
        if 0 < self.max_waiting < params.n:  # would never fit: not a "try again later"
            raise ValueError(
                f"n={params.n} samples are more than the waiting queue holds "
                f"(max_waiting={self.max_waiting})"
            )
        bad_words = self.llm._bad_words_token_ids(params)
        children = []
        for index in range(params.n):
            child = params if params.n == 1 else params.for_sample(index)
            req = Request(f"{request_id}-{index}", tokens, child)
            req.bad_words_token_ids = bad_words
            children.append(req)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), children)
        stream.sent_tokens = [0] * len(children)
        stream.sent_text = [0] * len(children)
        stream.done = [False] * len(children)
        with self._streams_lock:
            if request_id in self.streams:
                raise ValueError(f"request id {request_id!r} is already running")
            waiting = len(self.engine.scheduler.waiting) + self._queued
            if waiting + params.n > self.max_waiting:
                raise QueueFullError(
                    f"{waiting} requests are waiting (at most {self.max_waiting}): try again later"
                )
            self.streams[request_id] = stream
            self._queued += len(children)
        self.inbox.append(("add", request_id, stream))
        self.wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (finished or unknown ids are ignored). Returns at once; the
        stepping thread frees its KV blocks before its next step."""
        with self._streams_lock:
            stream = self.streams.get(request_id)
        if stream is not None:
            self.inbox.append(("abort", request_id, stream))
            self.wake.set()

    # -- the stepping thread --------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopped:
            if not self.wake.wait(timeout=0.5):
                continue
            with self.lock:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.wake.clear()
                    if self.inbox:  # arrived between the drain and the clear
                        self.wake.set()
                    continue
                try:
                    self.engine.step()
                    error = None
                except Exception as exc:  # the engine aborted the step's requests
                    logger.exception("engine step failed")
                    error = exc
                self._publish(error)

    def _drain_inbox(self) -> None:
        while self.inbox:
            kind, request_id, stream = self.inbox.popleft()
            with self._streams_lock:
                current = self.streams.get(request_id) is stream
                if kind == "add":
                    self._queued -= len(stream.children)
                elif current:
                    del self.streams[request_id]
            if not current:  # aborted before it was admitted, or an old id's late abort
                continue
            if kind == "abort":  # frees the blocks and forgets the requests
                self.engine.abort_request([r.request_id for r in stream.children])
                continue
            try:
                for req in stream.children:
                    self.engine.add_request(req)
            except Exception as exc:
                self.engine.abort_request([r.request_id for r in stream.children])
                with self._streams_lock:
                    self.streams.pop(request_id, None)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
                continue
            stream.admitted = True

    def _publish(self, error: BaseException | None) -> None:
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        with self._streams_lock:
            streams = [(rid, st) for rid, st in self.streams.items() if st.admitted]
        for request_id, stream in streams:
            out = deliveries.setdefault(stream.loop, [])
            for i, req in enumerate(stream.children):
                if stream.done[i]:
                    continue
                if req.finish_reason == "abort" and error is not None:
                    failure = RequestFailedError(f"request {request_id} failed: {error}")
                    out.append((stream.queue, failure))
                    stream.done = [True] * len(stream.children)
                    break
                delta = self._delta(stream, i, req)
                if delta is not None:
                    out.append((stream.queue, delta))
            if all(stream.done):
                with self._streams_lock:
                    del self.streams[request_id]
                for req in stream.children:
                    self.engine.release(req.request_id)
                out.append((stream.queue, None))
        for loop, items in deliveries.items():
            if items:  # one wake-up of each event loop per step, not one per delta
                loop.call_soon_threadsafe(_deliver, items)

    def _delta(self, stream: _Stream, i: int, req: Request) -> StreamDelta | None:
        tokens = req.output_token_ids
        text = (
            self.engine.output_text(req.request_id)
            if req.request_id in (self.engine.detokenizers)
            else ""
        )
        finished = req.is_finished
        if not finished and req.sampling_params.stop_strings:
            # Hold back what could be the start of a stop string: once sent, text cannot
            # be taken back when the stop completes (vLLM holds back the same).
            hold = max(len(stop) for stop in req.sampling_params.stop_strings) - 1
            text = text[: max(stream.sent_text[i], len(text) - hold)]
        new_tokens = tokens[stream.sent_tokens[i] :]
        new_text = text[stream.sent_text[i] :]
        if not new_tokens and not new_text and not finished:
            return None
        logprobs = req.output_logprobs[stream.sent_tokens[i] :]
        first = stream.sent_tokens[i] == 0 and stream.sent_text[i] == 0
        prompt_logprobs = list(req.prompt_logprobs) if first and req.prompt_logprobs else None
        stream.sent_tokens[i], stream.sent_text[i] = len(tokens), len(text)
        if finished:
            stream.done[i] = True
        return StreamDelta(
            index=i,
            text=new_text,
            token_ids=list(new_tokens),
            logprobs=list(logprobs),
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            prompt_logprobs=prompt_logprobs,
        )

    # -- state ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        scheduler = self.engine.scheduler
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + self._queued,
            "kv_cache_usage": scheduler.block_manager.usage(),
            **self.engine.spec_counts,
        }

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)


def _deliver(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _copy(out: CompletionOutput) -> CompletionOutput:
    """An output as it is now (the one being filled keeps growing)."""
    logprobs = list(out.logprobs) or None  # none asked: empty
    cumulative = sum(lp[t].logprob for lp, t in zip(logprobs, out.token_ids)) if logprobs else None
    return CompletionOutput(out.index, out.text, list(out.token_ids), cumulative, logprobs,
                            out.finish_reason, out.stop_reason)  # fmt: skip
