#!/usr/bin/env bash
# On a CUDA machine: the GPU-marked tests and the GPU benchmarks, results into $1.
# Budget: under 8 minutes. Usage: bash benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
python -m pip install -q -e . --no-deps 2>/dev/null || true
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 150 python benchmarks/bench_gpu.py --out "$out" 2>&1 | tee "$out/gpu_bench.log"
timeout 60 python benchmarks/pass_ablation.py --tokens 64 --repeats 2 2>&1 | tee "$out/pass_ablation.log"
exit "$tests"
