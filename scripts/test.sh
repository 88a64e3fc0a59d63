#!/usr/bin/env bash
# Run the whole test suite (CPU; GPU-marked tests skip without CUDA).
# Any arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
ruff check .
exec python -m pytest "$@"
