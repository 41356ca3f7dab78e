"""On-policy distillation on one GPU: what a Qwen3-4B-shaped teacher costs a Qwen3-0.6B-shaped student.

Random weights, one GPU, colocated student (same workload as benchmarks/rl_step_gpu.py: 64
trajectories per step of 128-token prompts and up to 256-token responses). Three runs of
`milepost train` in one call: no teacher (the baseline), the teacher in-process (sharded and
offloaded with the actor: `--opd-teacher-checkpoint`), and the teacher served by a separate
`milepost serve` on the same GPU (`--opd-teacher-url`). For each: median step time over steps
3..N, the teacher's wall time per step (`opd/teacher_time`) and its share of the step, and the
teacher's scoring throughput (prompt + response tokens scored per second of teacher time).
Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_step_gpu import QWEN3_06B, prompts  # the sibling benchmark script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoints(work: Path) -> tuple[Path, Path]:
    """The student (0.6B shape) and the teacher (4B shape), sharing one tokenizer."""
    from milepost.bench.train_setup import write_shape_checkpoint
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.tokenizer import save_tiny_tokenizer

    student = make_tiny_checkpoint(work / "student", "qwen3", **QWEN3_06B)
    teacher = write_shape_checkpoint("qwen3-4b", None, "cuda", seed=1)
    save_tiny_tokenizer(teacher, QWEN3_06B["vocab_size"])  # the student's, built the same way
    return student, teacher


def train(student: Path, data: Path, run_dir: Path, steps: int, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(student),
           "--prompt-data", str(data), "--apply-chat-template", "false",
           "--num-rollout", str(steps), "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
           "--rollout-max-response-len", "256", "--lr", "1e-6", "--colocate",
           "--reward-fn", "milepost.testing.rewards:token_parity_reward",
           "--run-dir", str(run_dir), "--engine-mem-fraction-static", "0.3",
           "--engine-max-total-tokens", str(64 * (128 + 256 + 32)),
           "--max-tokens-per-micro-batch", "8192", "--save-hf-at-end", "false", *extra]
    print(" ".join(cmd), flush=True)
    if subprocess.run(cmd, check=False).returncode != 0:
        for log in sorted((run_dir / "logs").glob("*.log")):
            print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}")
        raise SystemExit(f"run {run_dir.name} failed")
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def summarize(name: str, rows: list[dict]) -> dict:
    timed = [r for r in rows if r["step"] >= 2] or rows
    step = statistics.median(r["perf/step_time"] for r in timed)
    out = {"run": name, "median_step_s": step}
    if "opd/teacher_time" in timed[0]:
        teacher = statistics.median(r["opd/teacher_time"] for r in timed)
        # Every token of every trajectory is scored: prompt + response.
        tokens = statistics.median(64 * (128 + r["rollout/response_len_mean"]) for r in timed)
        out.update(teacher_s=teacher, teacher_share=teacher / step, teacher_tok_s=tokens / teacher)
    print(json.dumps(out), flush=True)
    return out


def serve_teacher(teacher: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "milepost", "serve", "--model-path", str(teacher),
                                 "--port", str(port), "--mem-fraction-static", "0.25", "--dtype", "bfloat16"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"teacher server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.kill()
    raise SystemExit("teacher server did not come up in 300 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", default="base,inprocess,served", help="comma-separated subset")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("opd_gpu.py needs CUDA")
    work = Path(tempfile.mkdtemp(prefix="milepost-opd-gpu-"))
    student, teacher = checkpoints(work)
    from transformers import AutoTokenizer

    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "label": ""}) + "\n"
                            for t in prompts(AutoTokenizer.from_pretrained(student), 64, 128, 0)))
    results = []
    runs = a.runs.split(",")
    if "base" in runs:
        results.append(summarize("no teacher", train(student, data, work / "base", a.steps, [])))
    if "inprocess" in runs:
        rows = train(student, data, work / "inproc", a.steps,
                     ["--opd-teacher-checkpoint", str(teacher), "--opd-coef", "1.0"])
        results.append(summarize("in-process 4B teacher", rows))
    if "served" in runs:
        proc, url = serve_teacher(teacher, work / "teacher.log")
        try:
            rows = train(student, data, work / "served", a.steps, ["--opd-teacher-url", url, "--opd-coef", "1.0"])
            results.append(summarize("served 4B teacher (same GPU)", rows))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    base = next((r["median_step_s"] for r in results if r["run"] == "no teacher"), None)
    for r in results:
        extra = f", {r['median_step_s'] / base:.2f}x the no-teacher step" if base else ""
        share = f", teacher {r['teacher_s']:.2f} s = {100 * r['teacher_share']:.0f}% of the step, " \
                f"{r['teacher_tok_s']:.0f} tok/s scored" if "teacher_s" in r else ""
        print(f"{r['run']}: median step {r['median_step_s']:.2f} s{share}{extra}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
