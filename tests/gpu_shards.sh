#!/usr/bin/env bash
# Run the GPU tests (`-m gpu`) as N parallel pytest processes and summarize them; exit 1 unless every shard
# finished with no failure. Why: the GPU machine has no pytest-xdist, and one process needs more than 300 s to
# compile the ~60 kernel variants. Each process gets OMP_NUM_THREADS = cores / N: with every process on all
# cores, the float64 CPU references oversubscribe the CPU (a 22 s test did not finish in 230 s).
# Usage (repository root, PYTHONPATH=. if not installed): bash tests/gpu_shards.sh [N=8] [TIMEOUT_S=300] [LOGDIR=.]
set -u
n=${1:-8}
limit=${2:-300}
logs=${3:-.}
ids=$(python -m pytest -q --collect-only -m gpu tests | grep ::)
threads=$(( $(nproc) / n ))
[ "$threads" -lt 1 ] && threads=1
for i in $(seq 0 $((n - 1))); do
  echo "$ids" | awk -v i="$i" -v n="$n" 'NR % n == i' | OMP_NUM_THREADS=$threads timeout "$limit" \
    xargs -r python -m pytest -q -p no:cacheprovider -rfE > "$logs/gpu_shard$i.log" 2>&1 &
done
wait
status=0
for i in $(seq 0 $((n - 1))); do
  last=$(tail -1 "$logs/gpu_shard$i.log")
  echo "shard $i: $last"
  if ! echo "$last" | grep -q "passed\|skipped" || echo "$last" | grep -q "failed\|error"; then
    status=1
  fi
done
exit $status
