"""Fully asynchronous vs synchronous RL on a long-tailed response-length workload (issue 5).

One invocation runs `milepost train` both ways on the same model, prompts and settings (same
number of steps x groups, so the same total trained groups) and prints trained response tokens
per second of each and their ratio. Workload (seeded): every prompt row carries its own
`sampling_params` with `ignore_eos`, so its responses have exactly the drawn length: most are
short, a few are `--long-factor` times longer (report 2.2: a synchronous step waits for its
slowest trajectory; the asynchronous worker keeps the engine's places full meanwhile).

    python benchmarks/async_vs_sync.py                 # tiny random Qwen3, CPU
    python benchmarks/async_vs_sync.py --model qwen3-0.6b --device cuda --shared-gpu-engine  # 1 GPU

Trained tokens/s = response tokens of every trained sample / the training loop's wall time
(sum of perf/step_time: from the first step's start to the last step's end, engine start-up
excluded in both modes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from milepost.testing.checkpoints import make_tiny_checkpoint

QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 4096, "tie_word_embeddings": True}

# Wide enough that one decode step is bound by reading the weights (~125 MB fp32), as decoding is
# on GPUs, while a trained token costs its FLOPs: the regime where a synchronous step's wait for
# its slowest trajectory dominates. The 2-layer tiny model is the opposite (trainer-bound on CPU).
MEDIUM = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
SHAPES = {"tiny": {}, "medium": MEDIUM, "qwen3-0.6b": QWEN3_06B}


def write_prompts(path: Path, n: int, short: int, long_factor: int, long_frac: float,
                  seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths = [short * long_factor if rng.random() < long_frac else short for _ in range(n)]
    with open(path, "w") as f:
        for i, length in enumerate(lengths):
            row = {"prompt": f"Tell a story about the number {i}.", "label": "",
                   "metadata": {"sampling_params": {"max_new_tokens": length, "ignore_eos": True}}}
            f.write(json.dumps(row) + "\n")
    return lengths


def recipe(work: Path, args: argparse.Namespace, long_len: int) -> Path:
    text = f"""
[model]
hf_checkpoint = "{work / 'model'}"
device = "{args.device}"
seed = 1

[placement]
trainer_cpu_threads = {args.trainer_threads}

[data]
prompt_data = "{work / 'prompts.jsonl'}"
apply_chat_template = false
rollout_shuffle = true

[rollout]
num_rollout = {args.steps}
rollout_batch_size = {args.batch}
n_samples_per_prompt = {args.n}
rollout_max_response_len = {long_len}
reward_fn = "milepost.testing.rewards:token_parity_reward"

[engine]
engine_max_total_tokens = {args.kv_tokens}

[algorithm]
use_rollout_logprobs = {str(not args.recompute_logprobs).lower()}

[optimizer]
lr = 1e-5
max_tokens_per_micro_batch = {args.micro_batch_tokens}

[checkpoint]
save_interval = 0
save_hf_at_end = false
"""
    path = work / "bench.toml"
    path.write_text(text)
    return path


def run(work: Path, toml: Path, name: str, extra: list[str],
        shared_gpu_engine: bool = False) -> dict[str, float]:
    """One `milepost train`. shared_gpu_engine: the engine is a `milepost serve` started here on
    the trainer's GPU (engine_backend external, weights by CUDA-IPC handoff), fresh for each run,
    so a machine with one GPU can run the disaggregated (not colocated) placement."""
    if shared_gpu_engine:
        from milepost.testing.server_process import ServerProcess

        with ServerProcess(work / "model", "--device", "cuda", "--mem-fraction-static", "0.3",
                           "--weight-version", "0", "--max-total-tokens", "65536",
                           timeout_s=300) as srv:
            return run(work, toml, name, [*extra, "--engine-backend", "external", "--engine-urls",
                                          srv.url, "--update-weight-transfer-mode", "tensor"])
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a left-over run would be resumed, not re-measured
    cmd = [sys.executable, "-m", "milepost", "train", str(toml), "--run-dir", str(run_dir), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, check=False)
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["rollout/response_len_mean"] * r["rollout/num_samples"] for r in records)
    loop_s = sum(r["perf/step_time"] for r in records)
    groups = sum(r["rollout/num_groups"] for r in records)
    return {"groups": groups, "tokens": tokens, "loop_s": loop_s, "tok_per_s": tokens / loop_s,
            "wall_s": time.perf_counter() - t0, "records": records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="prompts (groups) per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--short", type=int, default=16, help="tokens of a short response")
    ap.add_argument("--long-factor", type=int, default=10)
    ap.add_argument("--long-frac", type=float, default=0.15)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=sorted(SHAPES), default="medium")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="trainer micro-batch budget (packed attention cost grows with its square)")
    ap.add_argument("--max-inflight", type=int, default=None,
                    help="async in-flight limit; default batch * n, the sync step's concurrency")
    ap.add_argument("--recompute-logprobs", action="store_true",
                    help="trainer recomputes old log-probs (default: the engine's, both modes)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run sync/async pairs this many times (interleaved: drift hits both)")
    ap.add_argument("--shared-gpu-engine", action="store_true",
                    help="one GPU: start the engine on the trainer's GPU (external backend)")
    ap.add_argument("--trainer-threads", type=int, default=1,
                    help="CPU threads of the trainer in both modes (the engine has OMP_NUM_THREADS, "
                    "default 1): the same cores for both schedules")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "config.json").exists():
        make_tiny_checkpoint(work / "model", "qwen3", seed=1, **SHAPES[args.model])
    lengths = write_prompts(work / "prompts.jsonl", args.prompts, args.short, args.long_factor,
                            args.long_frac, args.seed)
    toml = recipe(work, args, args.short * args.long_factor)
    inflight = args.max_inflight or args.batch * args.n
    print(f"workload: {args.prompts} prompts, {sum(x > args.short for x in lengths)} long "
          f"({args.short * args.long_factor} tokens) / others {args.short} tokens; "
          f"{args.steps} steps x {args.batch} groups x {args.n} samples; async max_inflight {inflight}")
    ratios = []
    for i in range(args.repeats):
        sync = run(work, toml, "sync", [], args.shared_gpu_engine)
        fully = run(work, toml, "async", ["--fully-async", "--max-inflight", str(inflight)],
                    args.shared_gpu_engine)
        for name, r in (("sync", sync), ("fully async", fully)):
            print(f"[{i}] {name:12s} groups {r['groups']:.0f}  trained tokens {r['tokens']:.0f}  "
                  f"loop {r['loop_s']:.1f} s (rollout {total(r, 'perf/rollout_time'):.1f}, train "
                  f"{total(r, 'perf/train_time'):.1f}) -> {r['tok_per_s']:.1f} trained tok/s")
        recs = fully["records"]
        print(f"[{i}] fully async: mean in-flight "
              f"{total(fully, 'rollout/fully_async/inflight_mean') / len(recs):.1f}, trainer wait "
              f"{total(fully, 'perf/trainer_wait_time'):.1f} s, max staleness "
              f"{max(r['rollout/fully_async/max_staleness'] for r in recs):.0f}, prompts drawn "
              f"{recs[-1]['rollout/fully_async/prompts_drawn']:.0f}")
        ratios.append(fully["tok_per_s"] / sync["tok_per_s"])
        print(f"[{i}] ratio (fully async / sync trained tokens/s): {ratios[-1]:.2f}x")
    if len(ratios) > 1:
        print(f"ratios {', '.join(f'{r:.2f}' for r in ratios)}; median "
              f"{statistics.median(ratios):.2f}x")


def total(r: dict, key: str) -> float:
    return sum(rec.get(key, 0.0) for rec in r["records"])


if __name__ == "__main__":
    main()
