"""End-to-end runs of `milepost train` on CPU: real launcher, engines and trainer ranks (issue 3).

Every run is a `python -m milepost train` subprocess in its own session (so a test can kill the
whole tree) on a tiny random Qwen3 and a few arithmetic prompts. One reference run (2 trainer
ranks, disaggregated, broadcast, checksum-verified updates, rollouts saved) is shared by the
tests of metrics, export, weight-update parity, debug modes and kill + resume.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from milepost.data.rollout_io import load_rollout, rollout_path
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess

RUN_TIMEOUT_S = 240  # a tiny run takes ~10 s on 2 cores; past this it hangs
STEPS = 4
BASE = dict(
    num_rollout=STEPS, rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=8,
    engine_max_total_tokens=2048, lr=1e-3, save_interval=1, seed=7,
    reward_fn="e2e_train_rewards:parity",
)
# The metrics, as the driver names them.
STEP_METRICS = (
    "rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean",
    "rollout/truncated_frac", "rollout/prefix_cache_hit_rate", "rollout/tokens_per_s",
    "train/train_rollout_logprob_abs_diff", "train/kl", "train/pg_clipfrac", "train/entropy",
    "train/grad_norm", "train/lr", "perf/rollout_time", "perf/train_time",
    "perf/update_weights_time", "perf/step_time",
)
TRAIN_METRICS = ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/entropy",
                 "train/grad_norm", "train/lr", "train/train_rollout_logprob_abs_diff")

REWARDS = '''
"""Reward functions of the e2e runs (imported by the trainer through reward_fn)."""


def parity(sample):
    # Random-looking but deterministic 0/1 rewards: groups have variance, so training moves weights.
    return float(sum(sample.response_ids) % 2)


def always_raises(sample):
    raise RuntimeError("this reward function is broken on purpose")


_broken = []


def fails_on_the_first_prompt(sample):
    # Fails for every sample of the first prompt it sees, whatever the data order: that group
    # is dropped and the step asks for a replacement prompt.
    prompt = sample.metadata["prompt_index"]
    _broken[:] = _broken or [prompt]
    if prompt == _broken[0]:
        raise ValueError(f"no reward for prompt #{prompt}#")
    return parity(sample)
'''


# ---- fixtures and helpers ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train")
    make_tiny_checkpoint(root / "qwen3", "qwen3", seed=3)
    (root / "rewards").mkdir()
    (root / "rewards" / "e2e_train_rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3)]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def recipe(work: Path, name: str, **settings: object) -> Path:
    """work/NAME.toml: the tiny run's recipe, `settings` on top of BASE."""
    values = {"hf_checkpoint": str(work / "qwen3"), "prompt_data": str(work / "prompts.jsonl"),
              **BASE, **settings}
    lines = []
    for key, v in values.items():
        lines.append(f"{key} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}")
    path = work / f"{name}.toml"
    path.write_text(_tabled(lines))
    return path


def _tabled(lines: list[str]) -> str:
    from milepost.config import TABLE_OF

    tables: dict[str, list[str]] = {}
    for line in lines:
        tables.setdefault(TABLE_OF[line.split(" = ")[0]], []).append(line)
    return "".join(f"[{t}]\n" + "\n".join(ls) + "\n\n" for t, ls in tables.items())


def env(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(work / "rewards"), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}


@dataclass
class Run:
    run_dir: Path
    rc: int
    out: str
    seconds: float

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


def start(work: Path, run_dir: Path, *args: str, **settings: object) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "milepost", "train", str(recipe(work, run_dir.name, **settings)),
           "--run-dir", str(run_dir), *args]
    return subprocess.Popen(cmd, env=env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, run_dir: Path, t0: float, timeout: float = RUN_TIMEOUT_S) -> Run:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _killpg(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"milepost train hung for {timeout} s; output:\n{out[-6000:]}")
    left = wait_gone(proc.pid, timeout=10)
    assert not left, f"processes left behind: {left}"
    return Run(run_dir, proc.returncode, out, time.monotonic() - t0)


def train(work: Path, run_dir: Path, *args: str, timeout: float = RUN_TIMEOUT_S,
          terminal: bool = False, **settings: object) -> Run:
    t0 = time.monotonic()
    if terminal:
        return _train_on_pty(work, run_dir, args, t0, timeout, settings)
    return finish(start(work, run_dir, *args, **settings), run_dir, t0, timeout)


def _train_on_pty(work: Path, run_dir: Path, args: tuple[str, ...], t0: float, timeout: float,
                  settings: dict) -> Run:
    import pty

    cmd = [sys.executable, "-m", "milepost", "train", str(recipe(work, run_dir.name, **settings)),
           "--run-dir", str(run_dir), *args]
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, env={**env(work), "COLUMNS": "120"}, stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while True:  # read until every writer closed the pty (EIO), or time runs out
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
        if time.monotonic() > deadline:
            _killpg(proc.pid)
    os.close(master)
    rc = proc.wait(timeout=30)
    out = b"".join(chunks).decode(errors="replace")
    assert time.monotonic() <= deadline, f"milepost train hung:\n{out[-6000:]}"
    left = wait_gone(proc.pid, timeout=10)
    assert not left, f"processes left behind: {left}"
    return Run(run_dir, rc, out, time.monotonic() - t0)


def ok(run: Run) -> Run:
    assert run.rc == 0, f"milepost train failed ({run.rc}):\n{run.out[-6000:]}"
    return run


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> list[str]:
    """Command lines of live (non-zombie) processes of process group `pgid`."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            state, pgrp = fields[0], int(fields[2])
            if pgrp == pgid and state != "Z":
                alive.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return alive


def wait_gone(pgid: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def engine_pids(pgid: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            pgrp = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
            cmd = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        if pgrp == pgid and "serve" in cmd and "milepost" in cmd:
            pids.append(int(pid))
    return pids


def prompt_indices(rollouts: Path, step: int) -> list[int]:
    return [g[0].metadata["prompt_index"] for g in load_rollout(rollouts, step)]


@pytest.fixture(scope="module")
def reference(work: Path) -> Run:
    """2 trainer ranks, 1 engine, broadcast updates verified by checksum, rollouts saved."""
    run = ok(train(work, work / "ref", "--save-rollouts", str(work / "ref-rollouts"),
                   actor_num_gpus_per_node=2, check_weight_update=True))
    print(f"reference run: {run.seconds:.1f} s")
    return run


def check_finished(run: Run, steps: int = STEPS) -> list[dict]:
    ok(run)
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        missing = [k for k in STEP_METRICS if k not in r or r[k] is None or not math.isfinite(r[k])]
        assert not missing, f"step {r['step']} lacks {missing}"
    ckpts = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step_{s:08d}" for s in range(steps)]
    hf = run.run_dir / "hf"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    assert (hf / "tokenizer.json").is_file()
    return records


# ---- must reach ----------------------------------------------------------------------------------

def test_disaggregated_two_ranks_finishes_with_metrics_checkpoints_and_export(work, reference):
    records = check_finished(reference)
    assert any(r["train/grad_norm"] > 0 for r in records), "nothing was learned: rewards constant?"
    assert all(r["rollout/truncated_frac"] <= 1 and r["rollout/response_len_mean"] > 0 for r in records)
    # Weights moved: the export differs from the start, and it loads in transformers.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    start_w = load_file(work / "qwen3" / "model.safetensors")
    end_w = load_file(reference.run_dir / "hf" / "model.safetensors")
    assert start_w.keys() == end_w.keys()
    assert any(not torch.equal(start_w[k], end_w[k]) for k in start_w)
    model = AutoModelForCausalLM.from_pretrained(reference.run_dir / "hf")
    assert model.config.architectures == ["Qwen3ForCausalLM"]


def test_engine_logprobs_match_trainer_after_weight_updates(reference):
    # Every update was verified by checksum (check_weight_update) and the trainer's recomputed
    # log-probs of the engines' tokens match the engines' own (fp32).
    for r in reference.metrics():
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3, r
    # Direct check: `milepost serve` of the export scores a greedy continuation like transformers.
    from transformers import AutoModelForCausalLM

    hf = reference.run_dir / "hf"
    prompt = [1, 45, 200, 17, 9, 300, 2, 1, 77]
    with ServerProcess(hf, "--max-total-tokens", "512", "--dtype", "float32") as srv:
        body = httpx.post(f"{srv.url}/generate", timeout=60, json={
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()
    entries = body["meta_info"]["output_token_logprobs"]
    out_ids = [e[1] for e in entries]
    engine_lp = torch.tensor([e[0] for e in entries], dtype=torch.float64)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    logp = torch.log_softmax(logits, -1)
    assert out_ids == logp.argmax(-1).tolist()  # greedy under both
    hf_lp = logp.gather(-1, torch.tensor(out_ids)[:, None])[:, 0]
    assert torch.allclose(engine_lp, hf_lp, atol=1e-4), (engine_lp - hf_lp).abs().max()


def test_colocated_two_ranks_finishes_and_evaluates_when_due(work):
    run = train(work, work / "coloc", actor_num_gpus_per_node=2, colocate=True,
                check_weight_update=True, eval_interval=3,
                eval_prompt_data=str(work / "prompts.jsonl"), n_samples_per_eval_prompt=2)
    records = check_finished(run)
    resolved = (run.run_dir / "config.resolved.toml").read_text()
    assert 'update_weight_transfer_mode = "tensor"' in resolved
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in records)
    # Due after step 2 (every 3rd) and after the last; each score measured the weights just sent.
    evaluated = [r["step"] for r in records if "eval/reward_mean" in r]
    assert evaluated == [2, STEPS - 1]
    for r in records:
        if r["step"] in evaluated:
            assert r["eval/skipped"] == 0 and r["eval/mixed_version_frac"] == 0
            assert r["eval/weight_version"] == r["step"] + 1
            assert r["eval/num_samples"] == 16  # 8 prompts x 2 samples
            assert 0 <= r["eval/reward_mean"] <= 1 and r["perf/eval_time"] > 0
    print(f"colocated run: {run.seconds:.1f} s")


# ---- kill and resume -----------------------------------------------------------------------------

def test_kill_then_resume_continues_with_the_same_data(work, reference):
    run_dir = work / "killed"
    rollouts = work / "killed-rollouts"
    args = ("--save-rollouts", str(rollouts))
    settings = dict(actor_num_gpus_per_node=2, check_weight_update=True)
    t0 = time.monotonic()
    proc = start(work, run_dir, *args, **settings)
    marker = run_dir / "checkpoints" / "step_00000001" / "milepost_checkpoint.json"
    while not marker.exists():
        assert proc.poll() is None, f"the run ended before its 2nd checkpoint:\n{proc.stdout.read()}"
        assert time.monotonic() - t0 < RUN_TIMEOUT_S, "no 2nd checkpoint in time"
        time.sleep(0.05)
    # The harshest stop: SIGKILL the launcher alone (no cleanup code runs). Its engines and
    # trainer ranks must not outlive it.
    os.kill(proc.pid, signal.SIGKILL)
    kill_time = time.time()
    proc.communicate()
    left = wait_gone(proc.pid, timeout=30)
    _killpg(proc.pid)
    assert not left, f"orphans after the launcher was killed: {left}"

    from milepost.train.checkpoint import latest_checkpoint

    last = int(latest_checkpoint(run_dir).name.split("_")[1])
    assert last >= 1
    resumed = train(work, run_dir, *args, **settings)
    records = check_finished(resumed)
    for r in records:  # steps up to the checkpoint are the first run's, later ones the resumed run's
        assert (r["time"] < kill_time) == (r["step"] <= last), (r["step"], last)
    assert f"continuing at step {last + 1}" in resumed.out
    for step in range(STEPS):  # the same prompts in the same order as the uninterrupted run
        assert prompt_indices(rollouts, step) == prompt_indices(work / "ref-rollouts", step), step
    # Rerunning a finished run does nothing more (every step is in its checkpoint).
    again = ok(train(work, run_dir, *args, **settings))
    assert [r["step"] for r in again.metrics()] == list(range(STEPS))
    assert "nothing to train" in again.out and "engine 0" not in again.out, again.out[-3000:]


# ---- debug modes ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def replay(work: Path, reference: Run) -> Run:
    """The reference run's saved rollouts, trained on again without engines."""
    for step in range(STEPS):
        assert rollout_path(work / "ref-rollouts", step).is_file()
    return ok(train(work, work / "replay", "--load-rollouts", str(work / "ref-rollouts"),
                    actor_num_gpus_per_node=2))


def test_save_and_load_rollouts_reproduce_training(reference, replay):
    run = replay
    assert not (run.run_dir / "logs" / "engine-0.log").exists()
    ref, replay = reference.metrics(), run.metrics()
    assert [r["step"] for r in replay] == list(range(STEPS))
    for a, b in zip(ref, replay):
        for k in (*TRAIN_METRICS, "rollout/reward_mean", "rollout/response_len_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["step"], k)
    print(f"replay run: {run.seconds:.1f} s")


def test_streamed_optimizer_and_disk_offload_train_the_same(work, replay):
    # Issue 9 through `milepost train`: Adam moments streamed from files, the trainer evicted to
    # disk after every step; the same saved rollouts give bitwise the same weights as the plain
    # replay above, and every step reports how long the eviction took.
    run = ok(train(work, work / "memory", "--load-rollouts", str(work / "ref-rollouts"),
                   actor_num_gpus_per_node=2, stream_optimizer_state_to_disk=True,
                   optimizer_state_bucket_bytes=65536, offload_train=True,
                   offload_train_destination="disk", offload_staging_bytes=4096))
    assert all(r["perf/onload_time"] > 0 for r in run.metrics()[1:])
    assert sorted(p.name for p in (run.run_dir / "optimizer_state").iterdir()) == ["rank_0", "rank_1"]
    ckpt = run.run_dir / "checkpoints" / f"step_{STEPS - 1:08d}" / "optimizer_stream"
    assert sorted(p.name for p in ckpt.iterdir()) == ["rank_0", "rank_1"]
    from safetensors.torch import load_file

    plain = load_file(replay.run_dir / "hf" / "model.safetensors")
    streamed = load_file(run.run_dir / "hf" / "model.safetensors")
    assert all(torch.equal(plain[k], streamed[k]) for k in plain)


def test_rollout_only_generates_without_training(work):
    # On a terminal (a pty here), as a person runs it: the progress bar is a live rich bar.
    out = work / "only-rollouts"
    run = ok(train(work, work / "only", "--rollout-only", "--save-rollouts", str(out),
                   num_rollout=2, terminal=True))
    records = run.metrics()
    assert [r["step"] for r in records] == [0, 1]
    assert all("rollout/reward_mean" in r and not any(k.startswith("train/") for k in r)
               for r in records)
    assert [len(load_rollout(out, s)) for s in (0, 1)] == [2, 2]
    assert not (run.run_dir / "checkpoints").exists() and not (run.run_dir / "hf").exists()
    assert "reward_mean=" not in run.out and "2/2" in run.out  # the live bar, not plain lines


# ---- bad input -----------------------------------------------------------------------------------

def test_dataset_row_without_prompt_fails_at_start(work):
    bad = work / "bad.jsonl"
    bad.write_text('{"prompt": "1+1?", "label": "2"}\n{"question": "2+2?", "label": "4"}\n')
    run = train(work, work / "bad-data", prompt_data=str(bad), num_rollout=1)
    assert run.rc != 0
    assert f"{bad}:line 2" in run.out and "'prompt'" in run.out, run.out[-3000:]
    assert not (run.run_dir / "metrics.jsonl").exists() or not run.metrics()


def test_missing_reward_function_fails_at_start(work):
    run = train(work, work / "bad-reward", reward_fn="no_such_module:score", num_rollout=1)
    assert run.rc != 0
    assert "no_such_module:score" in run.out and "No module named" in run.out, run.out[-3000:]
    assert not (run.run_dir / "logs" / "engine-0.log").exists()  # refused before any engine


@pytest.fixture(scope="module")
def engine_killed(work: Path) -> tuple[Run, Path]:
    """One run for two claims (a run costs ~10 CPU-seconds): its reward fails for every sample
    of the first prompt it sees, its rollouts are saved, and its engine is SIGKILLed once two
    steps are logged. (run, the saved rollouts)."""
    run_dir, saved = work / "engine-killed", work / "engine-killed-rollouts"
    t0 = time.monotonic()
    proc = start(work, run_dir, "--save-rollouts", str(saved), num_rollout=1000, save_interval=0,
                 reward_fn="e2e_train_rewards:fails_on_the_first_prompt")
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() - t0 < RUN_TIMEOUT_S
        time.sleep(0.1)
    (pid,) = engine_pids(proc.pid)
    os.kill(pid, signal.SIGKILL)
    return finish(proc, run_dir, t0, timeout=120), saved


def test_reward_errors_are_counted_and_never_trained_on(engine_killed):
    run, saved = engine_killed  # its first two steps, logged before the engine was killed
    records = run.metrics()[:2]
    assert [r["rollout/reward_errors"] for r in records] == [1, 0]
    broken = int(run.out.split("no reward for prompt #")[1].split("#")[0])
    for step in (0, 1):
        groups = load_rollout(saved, step)
        indices = [g[0].metadata["prompt_index"] for g in groups]
        assert len(indices) == 2 and broken not in indices, (broken, indices)
        assert all(s.reward is not None for g in groups for s in g)
        # A replacement prompt gets its own group index: GRPO normalizes per group index.
        assert len({g[0].group_index for g in groups}) == 2
        assert all(len({(s.group_index, s.metadata["prompt_index"]) for s in g}) == 1
                   for g in groups)


def test_reward_function_that_always_raises_stops_the_run(work):
    run = train(work, work / "all-errors", reward_fn="e2e_train_rewards:always_raises",
                num_rollout=2)
    assert run.rc != 0
    assert "broken on purpose" in run.out and "reward" in run.out, run.out[-3000:]
    assert not (run.run_dir / "checkpoints").exists()


def test_engine_killed_mid_run_fails_naming_the_engine(engine_killed):
    run, _ = engine_killed
    run_dir = run.run_dir
    assert run.rc != 0
    assert "engine 0" in run.out and str(run_dir / "logs" / "engine-0.log") in run.out, run.out[-3000:]


def test_resume_from_a_checkpoint_of_another_model_is_refused(work, reference):
    other = make_tiny_checkpoint(work / "other-model", "qwen3", seed=3, num_hidden_layers=3)
    ckpt = reference.run_dir / "checkpoints" / f"step_{STEPS - 1:08d}"
    run = train(work, work / "other", "--resume", str(ckpt), hf_checkpoint=str(other))
    assert run.rc != 0
    assert str(ckpt) in run.out and str(other) in run.out, run.out[-3000:]
    assert not (run.run_dir / "logs" / "engine-0.log").exists()  # refused before any engine
