"""Faults under load: many streaming clients against `compilecore serve`, a third of them
going away at random points, a tenth sending bad requests, more at once than the waiting
queue holds. Afterwards every request and KV block must be gone, `/health` must answer,
`/metrics` must count what happened, and a greedy request must answer exactly as before.

Loopback only, bounded in requests (clients x rounds) and in time (--duration).

    python benchmarks/soak_server.py --clients 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Each is a 4xx from vLLM's server and ours: a bad value, a wrong type, an empty prompt,
# more tokens than the context holds, more samples than the queue, not JSON at all.
BAD_BODIES: list[dict | bytes] = [
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "max_tokens": "many"},
    {"prompt": []},
    {"prompt": "word " * 5000},
    {"prompt": "x", "n": 10**9},
    {"prompt": "x", "top_p": None, "logit_bias": {"not a token": 1}},
    b"{not json",
]
PROMPT_WORDS = ["the", "of", "compiler", "graph", "pass", "kernel", "token", "cache"]


def _percentile(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


class Tally:
    """What the clients saw."""

    def __init__(self) -> None:
        self.counts = {"completed": 0, "disconnected": 0, "bad_refused": 0, "queue_full": 0}
        self.failures: list[str] = []
        self.ttft: list[float] = []
        self.tokens = 0


async def _stream(http, url: str, body: dict, headers: dict, tally: Tally, cut: int | None) -> bool:
    """One streamed completion; `cut`: go away after that many events. False where the
    queue was full (503)."""
    start, first, events = time.perf_counter(), None, 0
    async with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code == 503:
            tally.counts["queue_full"] += 1
            return False
        if r.status_code != 200:
            tally.failures.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return True
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                tally.counts["completed"] += 1
                if first is not None:
                    tally.ttft.append(first - start)
                return True
            payload = json.loads(data)
            if "error" in payload:
                tally.failures.append(f"error event: {payload['error']}")
                return True
            if payload["choices"] and payload["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            tally.tokens += len(payload["choices"])
            events += 1
            if cut is not None and events >= cut:
                tally.counts["disconnected"] += 1
                return True  # leaving the block closes the connection mid-stream
        tally.failures.append("the stream ended without [DONE]")
        return True


@dataclass
class Load:
    """What each client sends: `rounds` requests, each a bad one (a tenth), a stream left
    after 1-6 events (a third) or a whole stream, until `deadline`."""

    url: str
    model: str
    headers: dict
    rounds: int
    max_tokens: int
    max_words: int
    deadline: float


async def _bad(http, load: Load, rng: random.Random, tally: Tally) -> None:
    bad = rng.choice(BAD_BODIES)
    kw = {"content": bad} if isinstance(bad, bytes) else {"json": {"model": load.model, **bad}}
    headers = {**load.headers, "Content-Type": "application/json"}
    r = await http.post(load.url, headers=headers, **kw)
    if 400 <= r.status_code < 500 and r.json()["error"]["message"]:
        tally.counts["bad_refused"] += 1
    else:
        tally.failures.append(f"bad request answered {r.status_code}: {r.text[:200]}")


async def _client(http, load: Load, rng: random.Random, tally: Tally) -> None:
    for _ in range(load.rounds):
        if time.perf_counter() > load.deadline:
            return
        roll = rng.random()
        words = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(1, load.max_words)))
        body = {
            "model": load.model,
            "prompt": words,
            "stream": True,
            "ignore_eos": True,
            "max_tokens": rng.randint(4, load.max_tokens),
            "temperature": rng.choice([0, 0.8]),
        }
        try:
            if roll < 0.1:
                await _bad(http, load, rng, tally)
            else:
                cut = rng.randint(1, 6) if roll < 0.1 + 1 / 3 else None
                for _ in range(3):  # a full queue: back off and try again, as clients do
                    if await _stream(http, load.url, body, load.headers, tally, cut):
                        break
                    await asyncio.sleep(rng.uniform(0.1, 0.5))
        except Exception as e:  # a dropped connection or a broken answer
            tally.failures.append(f"{type(e).__name__}: {e}")


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + (("{" + labels + "}") if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


async def _greedy(http, base: str, model: str, headers: dict) -> str:
    body = {"model": model, "prompt": "The compiler", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = await http.post(base + "/v1/completions", json=body, headers=headers)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def _settled(http, base: str, headers: dict, timeout: float) -> str:
    """/metrics once nothing runs, waits or holds a KV block (or the last one seen)."""
    deadline, text = time.perf_counter() + timeout, ""
    while time.perf_counter() < deadline:
        text = (await http.get(base + "/metrics", headers=headers)).text
        gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        if sum(_metric(text, f"compilecore:{g}") for g in gauges) == 0:
            break
        await asyncio.sleep(0.2)
    return text


async def soak(
    base: str,
    model: str,
    *,
    clients: int = 64,
    rounds: int = 3,
    max_tokens: int = 32,
    max_words: int = 40,
    duration: float = 300.0,
    seed: int = 0,
    api_key: str | None = None,
) -> dict:
    """Runs the load and the checks after it; a dict of what happened."""
    try:  # the openai client's own HTTP library: httpx2 from openai 3 on, httpx before
        import httpx2 as httpx
    except ImportError:
        import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        before = await _greedy(http, base, model, headers)
        tally, rng = Tally(), random.Random(seed)
        start = time.perf_counter()
        load = Load(
            base + "/v1/completions",
            model,
            headers,
            rounds,
            max_tokens,
            max_words,
            start + duration,
        )
        await asyncio.gather(
            *(_client(http, load, random.Random(rng.random()), tally) for _ in range(clients))
        )
        wall = time.perf_counter() - start
        metrics = await _settled(http, base, headers, timeout=30)
        health = (await http.get(base + "/health")).status_code
        after = await _greedy(http, base, model, headers)
    handled = sum(tally.counts.values())
    return {
        "clients": clients,
        **tally.counts,
        "failures": tally.failures,
        "wall_s": wall,
        "requests_per_s": handled / wall,
        "output_chunks_per_s": tally.tokens / wall,
        "ttft_p50_ms": _percentile(tally.ttft, 50) * 1e3,
        "ttft_p99_ms": _percentile(tally.ttft, 99) * 1e3,
        "after": {
            "running": _metric(metrics, "compilecore:num_requests_running"),
            "waiting": _metric(metrics, "compilecore:num_requests_waiting"),
            "kv_cache_usage": _metric(metrics, "compilecore:kv_cache_usage_perc"),
            "health": health,
            "greedy_unchanged": before == after,
            "metrics_counted": {
                status: _metric(metrics, "compilecore:requests_total", f'status="{status}"')
                for status in ("200", "400", "503", "disconnected", "500")
            },
        },
    }


def passed(result: dict) -> bool:
    """No client saw a failure; afterwards nothing runs, waits or holds a KV block,
    /health answers, greedy text is unchanged, and /metrics counted every stream (one the
    client left after its last token counts as a 200) and no internal error."""
    after, counted = result["after"], result["after"]["metrics_counted"]
    streams = result["completed"] + result["disconnected"]
    return (
        not result["failures"]
        and after["running"] == after["waiting"] == after["kv_cache_usage"] == 0
        and after["health"] == 200
        and after["greedy_unchanged"]
        and counted["200"] + counted["disconnected"] >= streams
        and counted["500"] == 0
    )


def main(argv: list[str] | None = None) -> int:
    from bench_serve import _free_port, _wait_healthy, serve_ours
    from common import RESULTS, save_results

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-waiting", type=int, default=16, help="small, to overflow it")
    parser.add_argument("--duration", type=float, default=300.0, help="stop starting requests")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.levels = [32]  # serve_ours sizes --max-num-seqs from it
    args.serve_args = ["--max-waiting", str(args.max_waiting)]
    port = _free_port()
    proc = serve_ours(args, port)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc)
        result = asyncio.run(
            soak(
                base,
                "model",
                clients=args.clients,
                rounds=args.rounds,
                max_tokens=args.max_tokens,
                duration=args.duration,
            )
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    result["passed"] = passed(result)
    print(json.dumps(result, indent=2))
    columns = [
        "clients",
        "completed",
        "disconnected",
        "bad_refused",
        "queue_full",
        "requests_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "passed",
    ]
    title = (
        f"faults under load: {args.clients} streaming clients x {args.rounds}, "
        f"max-waiting {args.max_waiting}, {args.dtype}"
    )
    save_results("soak", [result], columns, title, Path(args.out))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
