#!/usr/bin/env bash
# Run the whole test suite (CPU; GPU-marked tests skip without CUDA).
# Any arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`. Two workers, each
# taking whole files (a file's compiled-model fixtures stay in one process): most of the
# suite's time is single-threaded compiling, which one process left the second core idle
# for. COMPILECORE_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
ruff check .
exec python -m pytest -n "${COMPILECORE_TEST_WORKERS:-2}" --dist loadfile "$@"
