"""The train/rollout log-prob gap under each precision arrangement, one tiny RL workload.

Runs `milepost train` on the same tiny random Qwen3, prompts, seed and steps once per
`--precision` arrangement and prints `train/train_rollout_logprob_abs_diff` per step (on CPU the
trainer runs fp32, so "bf16" there means unquantized fp32 on both sides; `--device cuda` runs bf16
colocated on one GPU).

    python benchmarks/lowprec_gap.py --steps 3 --out /tmp/gap
    python benchmarks/lowprec_gap.py --steps 3 --device cuda --out /tmp/gap_cuda

`--demo DIR` runs the tiny demo instead (recipes/tiny_demo.toml on the base model and prompts that
`python -m milepost.demo.prepare DIR` wrote) and also prints each arrangement's reward per rollout
and its greedy held-out accuracy at the end: whether the demo learns under that arrangement.

    python benchmarks/lowprec_gap.py --demo runs/tiny-demo --steps 8 --device cuda --out /tmp/gap_demo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from milepost.testing.checkpoints import make_tiny_checkpoint

ARRANGEMENTS = {
    "bf16": [],
    "bf16-train-fp8-serve": ["--precision", "bf16-train-fp8-serve", "--ratio-correction", "none"],
    "fp8": ["--precision", "fp8"],
    "fp8 + delayed scaling": ["--precision", "fp8", "--fp8-scaling", "delayed"],
    "mxfp8": ["--precision", "mxfp8"],
    "nvfp4": ["--precision", "nvfp4"],
    "nvfp4 + four-over-six": ["--precision", "nvfp4", "--nvfp4-four-over-six"],
    "int4": ["--precision", "int4"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("/tmp/lowprec_gap"))
    p.add_argument("--only", default=None, help="comma-separated arrangement names")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--demo", type=Path, default=None,
                   help="the tiny demo's prepared directory: run recipes/tiny_demo.toml on it")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    workload = _demo_workload(a.demo, a.steps) if a.demo else _random_workload(a.out, a.steps)
    results = {}
    for name, flags in ARRANGEMENTS.items():
        if a.only and name not in a.only.split(","):
            continue
        run_dir = a.out / name.replace(" ", "_").replace("+", "")
        cmd = [sys.executable, "-m", "milepost", "train", *workload, "--run-dir", str(run_dir),
               *(["--device", "cpu"] if a.device == "cpu" else
                 ["--device", "cuda", "--dtype", "bfloat16", "--colocate"]), *flags]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            results[name] = f"failed: {(proc.stdout + proc.stderr)[-400:]}"
            print(name, results[name], flush=True)
            continue
        steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        gaps = [s["train/train_rollout_logprob_abs_diff"] for s in steps
                if "train/train_rollout_logprob_abs_diff" in s]
        rewards = [s["rollout/reward_mean"] for s in steps if "rollout/reward_mean" in s]
        evals = [s["eval/reward_mean"] for s in steps if "eval/reward_mean" in s]
        results[name] = {"abs_diff_per_step": gaps, "reward_per_rollout": rewards,
                         "eval_reward": evals, "seconds": round(time.monotonic() - t0, 1)}
        print(f"{name:24} abs diff per step {', '.join(f'{g:.3g}' for g in gaps)}", flush=True)
        if a.demo:
            print(f"{'':24} reward per rollout {', '.join(f'{r:.2f}' for r in rewards)}; "
                  f"greedy held-out {', '.join(f'{e:.3f}' for e in evals)}", flush=True)
    (a.out / "gap.json").write_text(json.dumps(results, indent=1))


def _random_workload(out: Path, steps: int) -> list[str]:
    """A tiny random Qwen3 on four sums: the gap only (it learns nothing in a few steps)."""
    ckpt = make_tiny_checkpoint(out / "qwen3", "qwen3", seed=5)
    rows = [{"prompt": f"What is {x} + {y}?", "label": str(x + y)}
            for x, y in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--hf-checkpoint", str(ckpt), "--prompt-data", str(out / "prompts.jsonl"),
            "--num-rollout", str(steps), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "8", "--engine-max-total-tokens", "2048",
            "--reward-fn", "exact_match", "--seed", "3"]


def _demo_workload(demo: Path, steps: int) -> list[str]:
    """The tiny demo's recipe on its prepared base model, evaluated greedily after the last step."""
    if not (demo / "base_model" / "config.json").exists():
        raise SystemExit(f"--demo {demo}: no base model there; run `python -m milepost.demo.prepare {demo}`")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_demo.toml"
    return [str(recipe), "--hf-checkpoint", str(demo / "base_model"),
            "--prompt-data", str(demo / "rl_prompts.jsonl"),
            "--eval-prompt-data", str(demo / "eval_prompts.jsonl"),
            "--num-rollout", str(steps), "--eval-interval", str(steps)]


if __name__ == "__main__":
    main()
