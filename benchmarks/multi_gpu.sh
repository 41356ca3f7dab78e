#!/usr/bin/env bash
# Issue 10: the runs that need several GPUs of one host, in one command. Each run writes its
# output to $OUT_DIR/<n>-<name>.txt and is skipped (with a line saying so) when the host has too
# few GPUs. Record the results in benchmarks/RESULTS.md with the date and the machine kind.
#   bash benchmarks/multi_gpu.sh [OUT_DIR]      (default OUT_DIR: ./multi_gpu_out)
# Runs (Qwen3-0.6B shape, random weights, bf16):
#   1 disaggregated RL, 1 trainer GPU + 1 engine GPU, NCCL broadcast, weight check   (2 GPUs)
#   2 FSDP2 training tokens/s on 1, 2, 4 GPUs, same global batch                     (2-4 GPUs)
#   3 p2p vs broadcast weight updates, 2 trainer + 2 engine GPUs                     (4 GPUs)
#   4 fully async vs sync, 2 engines + 2 trainer ranks, long-tailed lengths          (4 GPUs)
#   5 two engines behind sglang-router on 2 GPUs: multi-turn prefix-cache hit rate   (2 GPUs)
#   6 run 3 (p2p) under --launcher ray on a one-node Ray cluster (needs milepost[ray]) (4 GPUs)
set -u
OUT_DIR=${1:-multi_gpu_out}
mkdir -p "$OUT_DIR"
# NVLink multicast stays off (the device notes: it can hang shared machines).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $GPUS"
HERE=$(cd "$(dirname "$0")" && pwd)

run() {  # run <n-name> <gpus needed> <timeout s> <command...>
  local name=$1 need=$2 limit=$3; shift 3
  if [ "$GPUS" -lt "$need" ]; then
    echo "$name: skipped, needs $need GPUs, this host has $GPUS" | tee "$OUT_DIR/$name.txt"
    return
  fi
  echo "== $name ($(date -u +%H:%M:%S))"
  timeout "$limit" "$@" > "$OUT_DIR/$name.txt" 2>&1
  echo "$name: exit $?"; tail -12 "$OUT_DIR/$name.txt"
}

run 1-disaggregated 2 900 python3 "$HERE/rl_step_gpu.py" --steps 4 --no-colocate \
  --out "$OUT_DIR/1-metrics.jsonl" -- --update-weight-transfer-mode broadcast \
  --check-weight-update-equal
ranks=1,2; [ "$GPUS" -ge 4 ] && ranks=1,2,4
run 2-fsdp-scaling 2 900 python3 "$HERE/fsdp_scaling.py" --ranks $ranks --samples 32 --length 1024 \
  --json-out "$OUT_DIR/2-fsdp.json"
for mode in broadcast p2p; do
  run 3-weights-$mode 4 900 python3 "$HERE/rl_step_gpu.py" --steps 3 --no-colocate \
    --out "$OUT_DIR/3-$mode-metrics.jsonl" -- --actor-num-gpus-per-node 2 --rollout-num-engines 2 \
    --update-weight-transfer-mode $mode --check-weight-update-equal
done
run 4-async-vs-sync 4 1800 python3 "$HERE/async_vs_sync.py" --model qwen3-0.6b --device cuda \
  --launched-engines 2 --trainer-ranks 2 --steps 16 --batch 8 --n 4 --short 32 --long-factor 16 \
  --prompts 256 --kv-tokens 65536 --micro-batch-tokens 8192 --repeats 2
run 5-session-affinity 2 900 python3 "$HERE/session_affinity.py" --device cuda --sessions 32 \
  --turns 10 --concurrency 16
if python3 -c "import ray" 2>/dev/null; then
  run 6-ray-launcher 4 900 python3 -m milepost.launch.ray_cluster --nodes 1 --gpus-per-node "$GPUS" -- \
    python3 "$HERE/rl_step_gpu.py" --steps 3 --no-colocate --out "$OUT_DIR/6-ray-metrics.jsonl" -- \
    --launcher ray --actor-num-gpus-per-node 2 --rollout-num-engines 2 \
    --update-weight-transfer-mode p2p --check-weight-update-equal
else
  echo "6-ray-launcher: skipped, Ray is not installed (pip install 'milepost[ray]')" | tee "$OUT_DIR/6-ray-launcher.txt"
fi
