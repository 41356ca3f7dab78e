"""RL steps of a Qwen3-0.6B-shaped model (random weights) through `milepost train`.

Colocated by default; `--no-colocate -- --update-weight-transfer-mode broadcast
--check-weight-update-equal` gives the disaggregated run (one trainer GPU, one engine GPU).

64 trajectories per step (8 prompts x 8 samples) of ~128-token prompts and up to 256-token
responses; prints the step time split from the run's metrics.jsonl and the median step time
over steps 3..N (the issue's measure). `--trl` then runs TRL's GRPOTrainer on the same workload
(benchmarks/trl_grpo_baseline.py, TRL installed or carried as wheels) and prints the ratio of
median step times. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936, max_position_embeddings=4096)


def prompts(tokenizer, n: int, length: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(10, tokenizer.vocab_size, (length,), generator=g).tolist()
        out.append(tokenizer.decode(ids))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer and print the ratio")
    p.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="--max-tokens-per-micro-batch of the run (16384: the whole rollout in two passes)")
    p.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default=None, help="copy metrics.jsonl here")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after --: more `milepost train` settings, e.g. -- --actor-num-gpus-per-node 2 "
                   "--rollout-num-engines 2 --update-weight-transfer-mode p2p")
    a = p.parse_args()

    from milepost.testing.checkpoints import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp())
    model = make_tiny_checkpoint(work / "model", "qwen3", **QWEN3_06B)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    with open(work / "data.jsonl", "w") as f:
        for text in prompts(tok, 64, 128, 0):
            f.write(json.dumps({"prompt": text, "label": ""}) + "\n")
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(model),
           "--prompt-data", str(work / "data.jsonl"), "--apply-chat-template", "false",
           "--num-rollout", str(a.steps), "--rollout-batch-size", "8",
           "--n-samples-per-prompt", "8", "--rollout-max-response-len", "256",
           "--reward-fn", "milepost.testing.rewards:token_parity_reward", "--lr", "1e-6",
           "--run-dir", str(run_dir), "--engine-mem-fraction-static", "0.3",
           "--engine-max-total-tokens", str(64 * (128 + 256 + 32)),
           "--max-tokens-per-micro-batch", str(a.micro_batch_tokens), "--save-hf-at-end", "false"]
    cmd += ["--colocate"] if a.colocate else []
    cmd += [x for x in a.extra if x != "--"]
    print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        for log in sorted((run_dir / "logs").glob("*.log")):
            print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}")
        sys.exit(done.returncode)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = ["perf/rollout_time", "perf/train_time", "perf/update_weights_time", "perf/save_time",
            "perf/step_time", "rollout/tokens_per_s", "rollout/response_len_mean",
            "train/train_rollout_logprob_abs_diff"]
    print("step  " + "  ".join(k.split("/")[-1] for k in keys))
    for r in rows:
        print(f"{r['step']:4d}  " + "  ".join(f"{r.get(k, float('nan')):.3g}" for k in keys))
    timed = [r for r in rows if r["step"] >= 2] or rows  # steps count from 0: these are steps 3..N
    median = statistics.median(r["perf/step_time"] for r in timed)
    train = statistics.median(r["perf/train_time"] for r in timed)
    print(f"milepost: median step {median:.3f} s (train {train:.3f} s) over steps 3..{len(rows)}")
    if a.trl:
        out = work / "trl.json"
        script = Path(__file__).resolve().parent / "trl_grpo_baseline.py"
        subprocess.run([sys.executable, str(script), "--steps", str(max(a.steps, 2)), "--json-out", str(out)],
                       check=True)
        trl = json.loads(out.read_text())["median_s"]
        print(f"TRL GRPOTrainer: median step {trl:.3f} s; milepost is {trl / median:.2f}x faster (same run)")


if __name__ == "__main__":
    main()
