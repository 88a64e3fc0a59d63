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
# Two workers of 2 OpenMP threads share 2 cores: spinning waits made one worker's heavy
# test 3x slower (95 s alone, 238-300+ s in the suite); passive waits keep it near alone.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec python -m pytest -n "${COMPILECORE_TEST_WORKERS:-2}" --dist loadfile "$@"
