#!/usr/bin/env bash
# One sitting: every benchmark the README's "Performance" section reports, one after the
# other, every peer in the same run (about 20 minutes on 2 cores). Run nothing else on the
# machine meanwhile. Needs `bash scripts/setup.sh` (or scripts/run.sh) and, for the peers,
# `bash benchmarks/setup_peers.sh` once; a missing peer is reported, not an error.
# Results land in benchmarks/results/, each command's output in $LOGS (default a new
# temporary folder), printed at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
logs="${LOGS:-$(mktemp -d -t sitting.XXXX)}"
mkdir -p "$logs"

run() {  # name, then the command
    local name="$1"
    shift
    echo "$(date -u +%H:%M:%S) $name: $*"
    "$@" > "$logs/$name.log" 2>&1 || { echo "$name failed: see $logs/$name.log"; exit 1; }
}

echo "sitting from $(date -u '+%Y-%m-%d %H:%M:%S') UTC, logs in $logs"
run latency python benchmarks/bench_latency.py --tokens 128 --hf-compile
run latency_sampled python benchmarks/bench_latency.py --tokens 128 --hf-compile --sampled
run host python benchmarks/bench_host.py
run host_sampled python benchmarks/bench_host.py --sampled
run throughput python benchmarks/bench_throughput.py
run throughput_sampled python benchmarks/bench_throughput.py --sampled --batches ""
run startup python benchmarks/bench_startup.py
run serve python benchmarks/bench_serve.py
echo "sitting until $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
for f in latency latency_sampled host host_sampled batched throughput throughput_sampled \
    startup serve; do
    [ -f "benchmarks/results/$f.md" ] && cat "benchmarks/results/$f.md" && echo
done
