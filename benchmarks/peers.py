"""The benchmarks' peers, as `benchmarks/setup_peers.sh` builds them under the cache
directory: llama.cpp (its C++ tools and the llama-cpp-python binding) and the default
model's weights as BF16 / Q8_0 GGUF. Every benchmark says which peers are missing
instead of failing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from compilecore.config import cache_root

SETUP = "bash benchmarks/setup_peers.sh"


def peers_dir() -> Path:
    return cache_root() / "peers"


def gguf(outtype: str = "bf16") -> Path | None:
    path = peers_dir() / f"smollm2-135m-instruct-{outtype}.gguf"
    return path if path.is_file() else None


def llama_tool(name: str) -> Path | None:
    path = peers_dir() / "llama.cpp-build" / "bin" / name
    return path if path.is_file() else None


def ik_tool(name: str) -> Path | None:
    """ik_llama.cpp's build of a tool (setup_peers.sh --ik PATH), or None."""
    path = peers_dir() / "ik_llama.cpp-build" / "bin" / name
    return path if path.is_file() else None


def has_llama_cpp_python() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def missing(*, python: bool = False, tools: tuple[str, ...] = ()) -> list[str]:
    """What a benchmark needs and is not built here (empty: everything is)."""
    out = []
    if gguf("bf16") is None:
        out.append("the default model as BF16 GGUF")
    if python and not has_llama_cpp_python():
        out.append("llama-cpp-python")
    out += [tool for tool in tools if llama_tool(tool) is None]
    return out


def report_missing(what: list[str]) -> None:
    if what:
        print(f"[peers] not measured, missing: {', '.join(what)} (build them with: {SETUP})")


def llama_cpp_decode(
    path: Path, prompt: list[int], tokens: int, threads: int, sampling: dict | None = None
) -> float:
    """llama.cpp's batch-1 decode, tokens/s between the first and the last generated
    token (the timing every peer gets). Greedy, or with `sampling`'s temperature and top-p
    (llama.cpp's top-k and min-p off); EOS does not stop `generate`. In a process of its
    own: after ggml's threads have run in a process, torch's OpenMP team in it decodes ~20%
    slower (127-132 -> 100-102 tok/s, measured), so in-process rounds would handicap
    whichever engine runs second."""
    args = json.dumps([str(path), prompt, tokens, threads, sampling])
    out = subprocess.run([sys.executable, __file__, args], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return float(out.strip().splitlines()[-1])


def _llama_cpp_decode_here(
    path: Path, prompt: list[int], tokens: int, threads: int, sampling: dict | None
) -> float:
    from llama_cpp import Llama

    draw = {"temp": 0.0, "top_k": 1}  # greedy
    if sampling:  # top-k and min-p off, as in every engine
        draw = {
            "temp": sampling["temperature"],
            "top_p": sampling["top_p"],
            "top_k": 0,
            "min_p": 0.0,
        }

    llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    try:
        speeds = []
        for _ in range(2):  # the first run warms up
            times = []
            for _token in llm.generate(prompt, reset=True, **draw):
                times.append(time.perf_counter())
                if len(times) == tokens:
                    break
            speeds.append((tokens - 1) / (times[-1] - times[0]))
        return speeds[-1]
    finally:
        llm.close()


if __name__ == "__main__":  # llama_cpp_decode's child process
    path, prompt, tokens, threads, sampling = json.loads(sys.argv[1])
    print(_llama_cpp_decode_here(Path(path), prompt, tokens, threads, sampling))
