#!/usr/bin/env bash
# Main job: generate an answer with the embedded default model (SmolLM2-135M-Instruct).
# Any arguments go to `compilecore generate` (see `compilecore generate --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
if [ $# -eq 0 ]; then
    set -- "What is the capital of France?"
fi
exec compilecore generate "$@"
