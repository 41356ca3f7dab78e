#!/usr/bin/env bash
# Call B of the SmolLM2 reasoning-gym run (issue 25 item 3), right after call A on the same warm
# machine: join the GGUF parts, convert it, then GRPO on reasoning-gym tasks (the recipe's task
# with 2 seeds, a second task with 1 seed, all at once on the one GPU); held-out greedy accuracy
# before (base model) and after (the runs' evals, and the saved hf/ when a run finishes).
# Everything goes to $OUT/real.log. Budget: 405 s (give the call 450). Setup: prepare.sh here.
# Carry: .dev/smolB   (no .whl: the wheels it needs are in .dev/smolB/whl)
set -u
T0=$SECONDS
LOG=$OUT/real.log
exec > >(tee -a "$LOG") 2>&1
left() { echo $(( ${BUDGET:-405} - (SECONDS - T0) )); }
say() { echo "[$(( SECONDS - T0 )) s] $*"; }
TASK=gcd            # the recipe's task (reasoning-gym's gcd defaults: two numbers below 1000)
ALT=${ALT-letter_counting} # one more run beside it, on a second task
CONFIG='{}'
STEPS=${STEPS:-30}
DEVICE=${DEVICE:-cuda}; EXTRA=${EXTRA:-}; EVAL_SIZE=${EVAL_SIZE:-200}  # (a CPU dry run sets these)
W=${W:-/tmp/smol}
GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf
WANT=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p $W /tmp/site
date -u
if [ ! -f $W/part_aa ]; then say "no $W/part_aa: call A did not run on this machine (not warm?)"; exit 3; fi
cp .dev/smolB/part_ab $W/part_ab && cat $W/part_aa $W/part_ab > $GGUF
GOT=$(sha256sum $GGUF | cut -c1-64)
say "joined GGUF $(stat -c %s $GGUF) bytes sha256 $GOT"
[ "$GOT" = "$WANT" ] || { say "sha256 differs from $WANT: stop"; exit 4; }
[ -n "${SKIP_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/smolB/whl/*.whl; say "pip rc $?"
export PYTHONPATH=/tmp/site:$PWD:/tmp/site_rg:/tmp/rgstub PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
timeout 90 python3 benchmarks/smollm2_gpu/stubs.py /tmp/rgstub $TASK "$CONFIG" || { say "reasoning_gym not usable: stop"; exit 5; }
if [ -n "$ALT" ]; then timeout 60 python3 benchmarks/smollm2_gpu/stubs.py /tmp/rgstub $ALT "$CONFIG" || ALT=""; fi
say "reasoning_gym ready"

timeout 150 python3 -m milepost smollm2 $W/hf --gguf $GGUF; RC=$?
if [ $RC -ne 0 ] || [ ! -f $W/hf/tokenizer.json ]; then
  say "milepost smollm2 rc $RC; tokenizer fallback: the files converted on the CPU machine"
  ls $W/hf
  [ -f $W/hf/config.json ] && cp .dev/smolB/tok/* $W/hf/ && gunzip -f $W/hf/tokenizer.json.gz
fi
ls -la $W/hf; say "converted"

for t in $TASK $ALT; do
  python3 -m milepost.connectors.reasoning_gym $t --size 4000 --seed 0 --config "$CONFIG" \
    --system-prompt direct --few-shot 2 --out $W/train_$t.jsonl
  python3 -m milepost.connectors.reasoning_gym $t --size $EVAL_SIZE --seed 5000000 --config "$CONFIG" \
    --system-prompt direct --few-shot 2 --out $W/eval_$t.jsonl
  python3 benchmarks/smollm2_gpu/report.py overlap $W/train_$t.jsonl $W/eval_$t.jsonl
done
say "prompts written"

acc() {  # model task temperatures... : held-out accuracy (full marks only), our engine on the GPU
  local m=$1 t=$2; shift 2
  timeout ${ACC_T:-200} python3 benchmarks/prompt_accuracy.py $m $W/eval_$t.jsonl --max-new 16 --device $DEVICE \
    --reward-fn milepost.connectors.reasoning_gym:reward_exact --temperatures "$@" 2>&1 | grep -v -i warn
}
run() {  # task seed
  timeout $(( $(left) - 50 )) python3 -m milepost train recipes/smollm2_reasoning_gym.toml \
    --hf-checkpoint $W/hf --prompt-data $W/train_$1.jsonl --eval-prompt-data $W/eval_$1.jsonl \
    --device $DEVICE --seed $2 --rollout-seed $2 --num-rollout $STEPS --run-dir $W/run_$1_$2 $EXTRA > $W/run_$1_$2.log 2>&1
  echo "run $1 seed $2 rc $?" >> $W/run_$1_$2.log
}
# The base model's accuracy beside the training runs (same eval prompts; greedy, and T=1 x4).
(for t in $TASK $ALT; do ACC_T=300 acc $W/hf $t 0 1 --n-samples 4; done > $W/base.log 2>&1) &
BASE=$!
run $TASK 1 & R1=$!
run $TASK 2 & R2=$!
R3=""; if [ -n "$ALT" ]; then run $ALT 1 & R3=$!; fi
wait $BASE; say "base eval done"; cat $W/base.log
wait $R1 $R2 $R3; say "runs done"
RUNS="${TASK}_1 ${TASK}_2 ${ALT:+${ALT}_1}"
for r in $RUNS; do
  echo "=== run $r"; grep -E "Error|error|Traceback|rc " $W/run_$r.log | tail -8
  python3 benchmarks/smollm2_gpu/report.py metrics $W/run_$r/metrics.jsonl
done
# After: the final weights (run_dir/hf, written when a run finishes) through the same script, all at once.
for r in $RUNS; do
  if [ -f $W/run_$r/hf/config.json ] && [ $(left) -gt 25 ]; then
    (ACC_T=$(( $(left) - 3 )) acc $W/run_$r/hf ${r%_*} 0 > $W/after_$r.log 2>&1) & AFTER="${AFTER:-} $!"
  else say "run $r: no final hf/ (cut short) or no time left: its last eval above is the after-measure"; fi
done
[ -n "${AFTER:-}" ] && wait $AFTER  # (no bare `wait`: it may wait for the tee of the log too)
for r in $RUNS; do [ -f $W/after_$r.log ] && { echo "=== after, run $r"; cat $W/after_$r.log; }; done
say "done"; date -u
