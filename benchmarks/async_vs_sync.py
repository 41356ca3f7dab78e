"""Fully asynchronous vs synchronous RL on a long-tailed response-length workload (issue 5).

One invocation runs `milepost train` both ways on the same model, prompts and settings (same
number of steps x groups, so the same total trained groups) and prints trained response tokens
per second of each and their ratio. Workload (seeded): every prompt row carries its own
`sampling_params` with `ignore_eos`, so its responses have exactly the drawn length: most are
short, a few are `--long-factor` times longer (report 2.2: a synchronous step waits for its
slowest trajectory; the asynchronous worker keeps the engine's places full meanwhile).

    python benchmarks/async_vs_sync.py                 # tiny random Qwen3, CPU, 5 pairs
    python benchmarks/async_vs_sync.py --model qwen3-0.6b --device cuda --shared-gpu-engine  # 1 GPU

Same hardware for both modes: each run gets a fresh engine (`milepost serve`, external backend)
started here. On CPU the engine is pinned to core 0 and the trainer (with the rollout worker) to
core 1, one thread each, in both modes; unpinned, the async trainer and engine shared cores and
its training took 2-3x longer in bursts (the earlier spread of 0.95-2.33x). On one GPU the
engine shares the trainer's GPU (weights by CUDA-IPC handoff). Pairs alternate their order so a
drift in the machine's load hits both modes; each run reports the CPU the machine's other
processes used meanwhile.

Trained tokens/s = response tokens of the trained samples of steps `--warmup-steps`.. / the sum of
their perf/step_time (engine start-up and the first steps' one-time costs left out in both
modes; "all steps" also prints the ratio over every step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
trainer_cpu_threads = {getattr(args, "trainer_threads", 1)}

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


class OwnEngine:
    """The run's engine, a `milepost serve` started here (engine_backend external), fresh for each
    run so both modes start from the same empty cache. On CPU it is pinned to `cores` (taskset)
    with one thread per core, and the trainer to other cores: both modes get the same cores for
    the same parts, and the async trainer and engine cannot land on one core and fight for it.
    On one GPU (cores None) it shares the trainer's GPU; weights go by CUDA-IPC handoff."""

    def __init__(self, work: Path, device: str, kv_tokens: int, cores: str | None,
                 extra_flags: list[str], transfer_mode: str | None) -> None:
        from milepost.launch.process import ManagedProcess, free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "milepost", "serve", "--model-path", str(work / "model"),
               "--port", str(port), "--device", device, "--weight-version", "0",
               "--max-total-tokens", str(kv_tokens), "--random-seed", "1", "--log-level",
               "warning", *extra_flags]
        threads = 1
        if device == "cuda":
            cmd += ["--mem-fraction-static", "0.3"]
        if cores is not None:
            cmd = ["taskset", "-c", cores, *cmd]
            threads = len(parse_cores(cores))
        self.proc = ManagedProcess(f"engine on port {port}", cmd, work / "engine.log",
                                   f"{self.url}/health", env={"OMP_NUM_THREADS": str(threads)},
                                   timeout_s=300)
        self.flags = ["--engine-backend", "external", "--engine-urls", self.url]
        transfer_mode = transfer_mode or ("tensor" if device == "cuda" else None)
        if transfer_mode:
            self.flags += ["--update-weight-transfer-mode", transfer_mode]

    def close(self) -> None:
        self.proc.close()


def parse_cores(cores: str) -> list[int]:
    """'0' / '0,1' / '0-3' (taskset's list syntax) -> core ids."""
    out: list[int] = []
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


class CpuLoad:
    """Cores kept busy by OTHER processes while a run was on: the machine's busy time
    (/proc/stat) minus this benchmark's children's CPU time, over the wall time."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.ours0 = time.perf_counter(), machine_busy_s(), children_cpu_s()
        self.loadavg = Path("/proc/loadavg").read_text().split()[0]

    def others(self) -> float:
        wall = time.perf_counter() - self.t0
        busy = machine_busy_s() - self.busy0
        return max(busy - (children_cpu_s() - self.ours0), 0.0) / wall


def machine_busy_s() -> float:
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(work: Path, toml: Path, name: str, extra: list[str], args: argparse.Namespace
        ) -> dict[str, Any]:
    """One `milepost train` with its own engine. Timed: steps from `--warmup-steps` on (the
    first steps pay one-time costs in both modes; engine start-up is excluded in both)."""
    load = CpuLoad()
    engine = None if args.launched_engines else OwnEngine(
        work, args.device, args.kv_tokens, args.engine_cores, args.engine_flags.split(),
        args.weight_transfer_mode)
    try:
        run_dir = work / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a left-over run would be resumed, not re-measured
        cmd = [sys.executable, "-m", "milepost", "train", str(toml), "--run-dir", str(run_dir),
               *(engine.flags if engine else launched_placement(args)), *extra]
        if args.trainer_cores is not None:
            cmd = ["taskset", "-c", args.trainer_cores, *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    finally:
        if engine:
            engine.close()
    if proc.returncode != 0:
        tail = engine.proc.log_tail() if engine else f"see {work / name / 'logs'}"
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                 f"\nengine log tail:\n{tail}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[args.warmup_steps:]
    tokens = sum(r["rollout/response_len_mean"] * r["rollout/num_samples"] for r in timed)
    loop_s = sum(r["perf/step_time"] for r in timed)
    all_tokens = sum(r["rollout/response_len_mean"] * r["rollout/num_samples"] for r in records)
    return {"groups": sum(r["rollout/num_groups"] for r in records), "tokens": tokens,
            "loop_s": loop_s, "tok_per_s": tokens / loop_s, "records": timed,
            "groups_per_s": sum(r["rollout/num_groups"] for r in timed) / loop_s,
            "all_tok_per_s": all_tokens / sum(r["perf/step_time"] for r in records),
            "others_cores": load.others(), "loadavg": load.loadavg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=4, help="prompts (groups) per step")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--short", type=int, default=16, help="tokens of a short response")
    ap.add_argument("--long-factor", type=int, default=10)
    ap.add_argument("--long-frac", type=float, default=0.15)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="trainer micro-batch budget (packed attention cost grows with its square)")
    ap.add_argument("--max-inflight", type=int, default=None,
                    help="async in-flight limit; default 2 * batch * n")
    ap.add_argument("--recompute-logprobs", action="store_true",
                    help="trainer recomputes old log-probs (default: the engine's, both modes)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="sync/async pairs; the order alternates (sync first in even pairs) so "
                    "drift in the machine's load hits both modes alike")
    ap.add_argument("--warmup-steps", type=int, default=2,
                    help="first steps left out of the timing in both modes (one-time costs)")
    ap.add_argument("--engine-cores", default=None,
                    help="CPU: cores of the engine (taskset list); default 0")
    ap.add_argument("--trainer-cores", default=None,
                    help="CPU: cores of the trainer (taskset list); default 1; its thread count")
    ap.add_argument("--no-pin", action="store_true", help="CPU: leave placement to the OS")
    ap.add_argument("--shared-gpu-engine", action="store_true",
                    help="accepted for older command lines: on cuda the engine always shares the "
                    "trainer's GPU")
    ap.add_argument("--engine-flags", default="",
                    help="more `milepost serve` flags, e.g. '--cuda-graph-max-bs 64'")
    ap.add_argument("--weight-transfer-mode", default=None,
                    help="default: tensor (CUDA-IPC handoff) on cuda, broadcast on cpu")
    ap.add_argument("--launched-engines", type=int, default=0,
                    help="instead of the benchmark's own engine: this many engines started by "
                    "`milepost train` (one GPU each on cuda, after the trainer's), e.g. 2 engines "
                    "and --trainer-ranks 2 on a 4-GPU host")
    ap.add_argument("--trainer-ranks", type=int, default=1,
                    help="trainer ranks (with --launched-engines; one GPU each on cuda)")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    if args.trainer_ranks > 1 and not args.launched_engines:
        ap.error("--trainer-ranks > 1 needs --launched-engines (the own engine shares GPU 0)")
    if (args.batch * args.n) % args.trainer_ranks:
        ap.error(f"--batch x --n ({args.batch * args.n} samples per step) must split evenly over "
                 f"--trainer-ranks {args.trainer_ranks}")
    pin_cores(args)

    work = args.work or Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "config.json").exists():
        make_tiny_checkpoint(work / "model", "qwen3", seed=1, **SHAPES[args.model])
    lengths = write_prompts(work / "prompts.jsonl", args.prompts, args.short, args.long_factor,
                            args.long_frac, args.seed)
    toml = recipe(work, args, args.short * args.long_factor)
    inflight = args.max_inflight or 2 * args.batch * args.n
    print(f"workload: {args.prompts} prompts, {sum(x > args.short for x in lengths)} long "
          f"({args.short * args.long_factor} tokens) / others {args.short} tokens; "
          f"{args.steps} steps x {args.batch} groups x {args.n} samples; async max_inflight "
          f"{inflight}; timed from step {args.warmup_steps}; engine cores {args.engine_cores}, "
          f"trainer cores {args.trainer_cores}")
    modes = {"sync": [], "async": ["--fully-async", "--max-inflight", str(inflight)]}
    ratios, all_ratios = [], []
    for i in range(args.repeats):
        order = ["sync", "async"] if i % 2 == 0 else ["async", "sync"]
        res = {}
        for name in order:  # printed as each run ends: a run cut short still shows the other
            r = res[name] = run(work, toml, name, modes[name], args)
            print(f"[{i}] {name:5s} groups {r['groups']:.0f}  timed tokens {r['tokens']:.0f}  loop "
                  f"{r['loop_s']:.1f} s (rollout {total(r, 'perf/rollout_time'):.1f}, train "
                  f"{total(r, 'perf/train_time'):.1f}, trainer wait "
                  f"{total(r, 'perf/trainer_wait_time'):.1f}) -> {r['tok_per_s']:.0f} tok/s; "
                  f"others' load {r['others_cores']:.2f} cores (loadavg {r['loadavg']})",
                  flush=True)
        recs = res["async"]["records"]
        print(f"[{i}] async: mean in-flight "
              f"{total(res['async'], 'rollout/fully_async/inflight_mean') / len(recs):.1f}, max "
              f"staleness {max(r['rollout/fully_async/max_staleness'] for r in recs):.0f}, prompts "
              f"drawn {recs[-1]['rollout/fully_async/prompts_drawn']:.0f}")
        ratios.append(res["async"]["tok_per_s"] / res["sync"]["tok_per_s"])
        all_ratios.append(res["async"]["all_tok_per_s"] / res["sync"]["all_tok_per_s"])
        # Trained groups/s too: on a short run async trains more of the short groups first (the
        # long ones are still generating at the end), which lowers its tokens, not its groups.
        print(f"[{i}] ratio (async / sync trained tokens/s): {ratios[-1]:.2f}x "
              f"(all steps: {all_ratios[-1]:.2f}x; trained groups/s: "
              f"{res['async']['groups_per_s'] / res['sync']['groups_per_s']:.2f}x)")
    print(f"ratios {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}x (all steps: median "
          f"{statistics.median(all_ratios):.2f}x)")


def launched_placement(args: argparse.Namespace) -> list[str]:
    """Disaggregated placement by `milepost train` itself: its engines and trainer ranks, one GPU
    each on cuda (engines after the trainer's GPUs), weights by `--weight-transfer-mode`."""
    return ["--rollout-num-engines", str(args.launched_engines),
            "--actor-num-gpus-per-node", str(args.trainer_ranks),
            "--update-weight-transfer-mode", args.weight_transfer_mode or "broadcast"]


def pin_cores(args: argparse.Namespace) -> None:
    """CPU default: engine on core 0, trainer on core 1 (the rest left to others)."""
    if args.device != "cpu" or args.no_pin:
        args.engine_cores = args.trainer_cores = None
        return
    if (os.cpu_count() or 1) < 2:
        sys.exit("pinning needs 2 cores (one engine, one trainer); use --no-pin")
    args.engine_cores = args.engine_cores or "0"
    args.trainer_cores = args.trainer_cores or "1"
    args.trainer_threads = len(parse_cores(args.trainer_cores))


def total(r: dict, key: str) -> float:
    return sum(rec.get(key, 0.0) for rec in r["records"])


if __name__ == "__main__":
    main()
