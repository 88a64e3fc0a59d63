from __future__ import annotations

import contextlib
import ctypes
import gc
import os

# Without a GPU, Triton kernels are tested in the interpreter. Set before torch is imported:
# torch._dynamo imports triton.language, and Triton makes each function interpreted or not
# when it is defined, its own helpers (`tl.sum`) included; under Triton 3.6 a kernel that
# calls a helper defined before the variable was set fails.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import build_tokenizer, llama_config, save_checkpoint  # noqa: E402

os.environ.setdefault("PYTHONBREAKPOINT", "0")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    """(folder, HF model) of a 2-layer GQA Llama with a tokenizer; shared by the session."""
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = save_checkpoint(path, llama_config(), tokenizer_dir=tokenizer_dir)
    return path, hf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_llama):
    """(GGUF file, oracle) of the tiny Llama: Q4_1 layers, a Q4_0 MLP, a Q8_0 v projection
    (its QKV held per part), a Q8_0 embedding and a Q5_0 head (not kept: dequantized at
    load); the oracle is the HF model holding gguf-py's dequantization of every weight
    (tests/gguf_files.py)."""
    from tests.gguf_files import Q, write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    types = {"embed_tokens": Q.Q8_0, "layers.1.mlp": Q.Q4_0, "layers.1.self_attn.v_proj": Q.Q8_0,
             "lm_head": Q.Q5_0}  # fmt: skip
    return path, write_gguf(path, tiny_llama[1], types, Q.Q4_1)


@pytest.fixture(scope="session")
def default_model_dir():
    from models.default_model import DefaultModelError, ensure_default_model

    try:
        return ensure_default_model()
    except DefaultModelError as e:  # pragma: no cover - the setup script installs it
        pytest.fail(str(e))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_module(request):
    """After each test file: collect what its tests left (engines, compiled code) and hand
    the freed heap back to the OS (glibc keeps it otherwise), so that a worker's resident
    size does not carry one heavy file's peak into the next while the other worker runs
    its own (the suite's limit is 6 GB on two workers). With COMPILECORE_TEST_RSS_LOG set,
    each file's resident size before and after goes to that file, to find the heavy ones."""
    yield
    before = _rss_mb()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    log = os.environ.get("COMPILECORE_TEST_RSS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{request.module.__name__} {before} {_rss_mb()}\n")


def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
