#!/usr/bin/env bash
# On a CUDA machine: the device check (benchmarks/gpu_check.py: GPU tests, CPU-vs-GPU
# greedy tokens, sampling, CUDA graphs vs eager, 1B decode vs copy bandwidth, passes on and
# off, TP=2 with two devices), then the pass ablation. Results into $1. Under 8 minutes.
# Usage: bash benchmarks/gpu_check.sh OUT_DIR [--dry-run]   (--dry-run: CPU, tiny models)
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR [--dry-run]}"
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python -m pip install -q -e . --no-deps 2>/dev/null || true
timeout 420 python benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
check=${PIPESTATUS[0]}
if [[ " $* " != *" --dry-run "* ]]; then
  timeout 60 python benchmarks/pass_ablation.py --tokens 64 --repeats 2 2>&1 | tee "$out/pass_ablation.log"
fi
exit "$check"
