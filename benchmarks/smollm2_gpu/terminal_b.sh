#!/usr/bin/env bash
# Issue 25 item 4, call B of two, right after terminal_a.sh on the same warm machine: join
# and convert SmolLM2-135M-Instruct, measure its solve rate on the terminal easy tier's held-out
# tasks (benchmarks/terminal_solve_rate.py: 18 tasks x EPIS episodes, T=0.7, up to 8 calls of 48
# tokens, as the training episodes), GRPO on the 30 train tasks (recipes/agentic_terminal_easy.toml
# on the GPU, seeds 1 and 2 at once), then the same measurement on each run's final hf/.
# The base measurement runs beside the two trainings. Everything goes to $OUT/term.log.
# Budget: BUDGET s (default 300; give the call 330). Carry: runs/smol_termB (part_ab, whl/, bin/bwrap).
set -u
T0=$SECONDS
LOG=$OUT/term.log
exec > >(tee -a "$LOG") 2>&1
left() { echo $(( ${BUDGET:-300} - (SECONDS - T0) )); }
say() { echo "[$(( SECONDS - T0 )) s] $*"; }
STEPS=${STEPS:-6}; LR=${LR:-2e-5}; EPIS=${EPIS:-8}; BATCH=${BATCH:-8}
DEVICE=${DEVICE:-cuda}; W=${W:-/tmp/smol}  # (a CPU dry run sets DEVICE=cpu W=... SITE=... SKIP_PIP=1)
# FORCE_UNSAFE=1 passes the unsafe switch even where bubblewrap works (which then still isolates).
 GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf
WANT=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
date -u
[ -f $W/part_aa ] || { say "no $W/part_aa: terminal_a.sh did not run on this machine (not warm?)"; exit 3; }
cat $W/part_aa runs/smol_termB/part_ab > $GGUF
GOT=$(sha256sum $GGUF | cut -c1-64); say "joined GGUF sha256 $GOT"
[ "$GOT" = "$WANT" ] || { say "sha256 differs from $WANT: stop"; exit 4; }
[ -n "${SKIP_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site runs/smol_termB/whl/*.whl; say "pip rc $?"
export PYTHONPATH=${SITE:-/tmp/site}:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if ! command -v bwrap >/dev/null; then  # Debian 12's bubblewrap 0.8 binary, carried
  mkdir -p /tmp/bin && cp runs/smol_termB/bin/bwrap /tmp/bin/ && chmod 755 /tmp/bin/bwrap && export PATH=/tmp/bin:$PATH
  ldd /tmp/bin/bwrap | grep -i "not found"
fi
PROBLEM=$(python3 -c "from milepost.envs.sandbox import isolation_problem as p; print(p() or '')" 2>&1 | tail -1)
[ -n "${FORCE_UNSAFE:-}" ] && PROBLEM="forced by FORCE_UNSAFE (dry run)"
if [ -z "$PROBLEM" ]; then
  say "SANDBOX: bubblewrap isolates here ($(command -v bwrap))"; AGENT=""; UNSAFE=""
else
  say "SANDBOX: none here ($PROBLEM); episodes run through the explicit unsafe switch (as root:"
  say "  commands as the sandbox's own uid >= 100000 under prlimit, in a temp directory; no network here)"
  AGENT="--agent-function-path milepost.envs.terminal:terminal_agent_fn_unsafe_no_sandbox"; UNSAFE="--allow-unsafe-no-sandbox"
fi
timeout 120 python3 -m milepost smollm2 $W/hf --gguf $GGUF >/dev/null 2>&1; say "convert rc $?"; ls $W/hf
python3 -m milepost.envs.tasks $W/easy.jsonl --tier easy
rate() {  # model out-name: held-out solve rate, the training episodes' settings
  timeout $(( $(left) - 5 )) python3 benchmarks/terminal_solve_rate.py $1 --tier easy_heldout --episodes $EPIS \
    --temperature 0.7 --max-new 48 --max-turns 8 --parallel 72 --device $DEVICE $UNSAFE \
    --json-out $OUT/$2.json 2>&1 | grep -v -i warn | tail -3
}
run() {  # seed
  timeout $(( $(left) - ${AFTER_S:-75} )) python3 -m milepost train recipes/agentic_terminal_easy.toml \
    --hf-checkpoint $W/hf --prompt-data $W/easy.jsonl --device $DEVICE --colocate true \
    --engine-max-total-tokens 65536 --rollout-batch-size $BATCH --global-batch-size $(( BATCH * 4 )) \
    --lr $LR --num-rollout $STEPS --seed $1 --rollout-seed $1 --run-dir $W/run_$1 $AGENT > $W/run_$1.log 2>&1
  echo "run seed $1 rc $?" >> $W/run_$1.log
}
(rate $W/hf base > $W/base.log 2>&1) & BASE=$!
run 1 & R1=$!
run 2 & R2=$!
wait $BASE; say "base (held out):"; cat $W/base.log
wait $R1 $R2; say "runs done"
for s in 1 2; do
  echo "=== run seed $s"; grep -E "Error|error|Traceback|rc |env_error" $W/run_$s.log | tail -8
  python3 - $W/run_$s/metrics.jsonl <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
print("step reward_mean reward_errors resp_len step_s rollout_s train_s update_s")
for m in rows:
    if "step" in m:
        g = lambda k: "-" if m.get(k) is None else f"{m[k]:.3f}"
        print(m["step"], g("rollout/reward_mean"), g("rollout/reward_errors"), g("rollout/response_len_mean"),
              g("perf/step_time"), g("perf/rollout_time"), g("perf/train_time"), g("perf/update_weights_time"))
PY
  cp $W/run_$s.log $OUT/run_$s.log; [ -f $W/run_$s/metrics.jsonl ] && cp $W/run_$s/metrics.jsonl $OUT/metrics_$s.jsonl
done
for s in 1 2; do
  if [ -f $W/run_$s/hf/config.json ] && [ $(left) -gt 20 ]; then (rate $W/run_$s/hf after_$s > $W/after_$s.log 2>&1) & AFTER="${AFTER:-} $!"
  else say "run seed $s: no final hf/ (cut short) or no time left"; fi
done
[ -n "${AFTER:-}" ] && wait $AFTER
for s in 1 2; do [ -f $W/after_$s.log ] && { echo "=== after, seed $s (held out)"; cat $W/after_$s.log; }; done
say "done"; date -u
