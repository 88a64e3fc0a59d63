#!/usr/bin/env bash
# On a CUDA machine: the device check (benchmarks/gpu_check.py: the GPU-marked test files,
# CPU-vs-GPU greedy tokens, sampling, CUDA graphs vs eager, 1B decode vs copy bandwidth,
# passes on and off, TP=2 with two devices). Results into $1. The pass ablation (four cold
# compiles) is not in it: run benchmarks/pass_ablation.py on its own when time allows.
# Usage: bash benchmarks/gpu_check.sh OUT_DIR [--dry-run]   (--dry-run: CPU, tiny models)
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR [--dry-run]}"
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python -m pip install -q -e . --no-deps 2>/dev/null || true
timeout 420 python benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
