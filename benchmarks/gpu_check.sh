#!/usr/bin/env bash
# On a CUDA machine: the device check (benchmarks/gpu_check.py: the GPU-marked test files,
# CPU-vs-GPU greedy tokens, sampling, CUDA graphs (full and piecewise) vs eager, 1B decode
# vs copy bandwidth, passes on and off, TP=2 with two devices). Results into $1. The pass
# ablation (four cold compiles) is not in it: run benchmarks/pass_ablation.py on its own.
# Usage: bash benchmarks/gpu_check.sh OUT_DIR [--dry-run] [--steps NAME...]
# The repository is put on PYTHONPATH rather than installed: a device machine may have no
# package index, and pip's retries against one would spend the check's minutes.
# GPU_CHECK_TIMEOUT (seconds, default 300) bounds the whole check; PYTHON names the interpreter.
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR [--dry-run] [--steps NAME...]}"
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout "${GPU_CHECK_TIMEOUT:-300}" "${PYTHON:-python3}" benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
