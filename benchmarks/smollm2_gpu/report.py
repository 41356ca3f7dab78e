"""Helpers of call_b.sh: `overlap TRAIN EVAL` (eval questions also in train), `metrics FILE` (curve)."""
import json
import os
import sys

if sys.argv[1] == "overlap":
    def q(p: str) -> list[str]:
        with open(p) as f:
            return [json.loads(line)["prompt"][-1]["content"] for line in f]

    tr, ev = set(q(sys.argv[2])), q(sys.argv[3])
    print(f"{os.path.basename(sys.argv[3])}: {len(ev)} held-out prompts, {sum(x in tr for x in ev)} "
          f"of them also among the {len(tr)} distinct train questions")
else:
    rows = []
    if os.path.exists(sys.argv[2]):
        with open(sys.argv[2]) as f:
            rows = [json.loads(line) for line in f]

    def g(m: dict, k: str) -> str:
        v = m.get(k)
        return "-" if v is None else f"{v:.3f}"

    print("step reward_mean eval_acc(greedy,exact) resp_len step_s rollout_s train_s update_s eval_s")
    for m in rows:
        if "step" in m:
            print(m["step"], g(m, "rollout/reward_mean"), g(m, "eval/reward_mean"),
                  g(m, "rollout/response_len_mean"), g(m, "perf/step_time"), g(m, "perf/rollout_time"),
                  g(m, "perf/train_time"), g(m, "perf/update_weights_time"), g(m, "perf/eval_time"))
