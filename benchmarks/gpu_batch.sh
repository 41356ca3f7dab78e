#!/usr/bin/env bash
# Runs a list of GPU steps inside one device call's time (10 minutes at most), so that one slow or
# hung step costs only its own slot. Each line of STEPS_FILE is `SECONDS NAME COMMAND...`: a step
# starts only if SECONDS fit in what is left of BUDGET_S, is killed after SECONDS, and its output is
# appended, with its exit status and wall time, to $OUT/batch.log (the device returns at most 8
# files, so every step shares that one log). Lines starting with # are skipped.
#   bash benchmarks/gpu_batch.sh 560 benchmarks/gpu_steps/1_engine.txt
# It installs the carried wheels of benchmarks/gpu_wheels.sh first (carry `.whl`).
set -uo pipefail
budget=${1:?usage: gpu_batch.sh BUDGET_S STEPS_FILE}
steps=${2:?usage: gpu_batch.sh BUDGET_S STEPS_FILE}
out=${OUT:-/tmp/gpu_batch}
mkdir -p "$out"
log="$out/batch.log"
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed" | tee -a "$log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH  # bin: py-spy
fi
export PYTHONUNBUFFERED=1 OUT="$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log"
while read -r secs name cmd; do
  case "$secs" in ''|'#'*) continue ;; esac
  left=$(( budget - ($(date +%s) - start) ))
  if (( secs > left )); then
    echo "=== SKIP $name: needs ${secs}s, ${left}s left" | tee -a "$log"
    continue
  fi
  echo "=== STEP $name (limit ${secs}s): $cmd" | tee -a "$log"
  t0=$(date +%s)
  timeout -k 10 "$secs" bash -c "$cmd" >>"$log" 2>&1 </dev/null
  rc=$?
  echo "=== END $name rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$log"
done <"$steps"
echo "=== batch done in $(( $(date +%s) - start ))s" | tee -a "$log"
