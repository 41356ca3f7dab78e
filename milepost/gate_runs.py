"""The runs behind the metric-history gate: each standard names how to make a fresh, deterministic
run and which of its metrics are registered (compared against benchmarks/history/NAME.jsonl).

`pipeline` is the CI standard: `milepost train --deterministic` (real launcher, engine process,
trainer rank, weight updates, evaluation) on a tiny random Qwen3 with a token-parity reward, so
groups have reward variance and every loss term moves. It is no recipe's proxy: a random model
cannot learn the demo's task in seconds. `tiny_demo_proxy` runs the demo recipe itself, scaled
down to 5 rollouts (opt-in: building its base model takes minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Metrics that measure time or speed are never bit-exact; they are not registered. Nor is the
# prefix-cache hit rate: which requests share a prefix block depends on when each arrived (two
# identical deterministic runs measured 0.41-0.70 on the same step).
_UNREGISTERED_PARTS = ("perf/", "_per_s", "_time", "time_s", "elapsed", "latency")
_UNREGISTERED = {"step", "time", "rollout/prefix_cache_hit_rate"}
# Banded, not exact: the engine's log-probs depend on the batch a request was computed in (CPU
# GEMMs of other shapes sum in another order), so the train-rollout mismatch moves in its last
# bits: 2.5e-7 to 3.3e-7 over the same steps of two identical runs (2026-12-03). The band is
# three times that spread's top; a real mismatch regression is orders of magnitude larger.
DEFAULT_BANDS = {"train/train_rollout_logprob_abs_diff": 1e-6}
# A standard is compared bit for bit on whichever x86 machine CI lands on, so no library may choose
# its kernels by the processor: torch's own vector kernels, MKL's GEMMs (its conditional numerical
# reproducibility mode) and oneDNN are held to their AVX2 code. Unpinned, the standard written on
# one CI machine differed on another (an AVX-512/AMX Xeon, 2026-12-04) from step 0's grad_norm on,
# by 1e-7; each of the three pins alone moved this machine's numbers.
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def registrable(name: str) -> bool:
    """A metric the gate can hold to a standard (not a timing, not the step counter)."""
    return name not in _UNREGISTERED and not any(part in name for part in _UNREGISTERED_PARTS)


def token_parity(sample: Any) -> float:
    """The `pipeline` standard's reward: 1 when the response's token ids sum to an odd number.
    Arbitrary but a pure function of the tokens, so groups differ and training moves weights."""
    return float(sum(sample.response_ids) % 2)


@dataclass(frozen=True)
class GateRun:
    """name: the history file's stem. prepare(work) builds the inputs and returns the
    `milepost train` argv (after `milepost train`). recipe: the recipe it runs itself, or None;
    proxy_of: the recipe it is a documented scaled-down proxy of, or None.
    budget_s: the most seconds a run may take before it counts as hung."""

    name: str
    description: str
    prepare: Callable[[Path], list[str]]
    recipe: str | None = None
    proxy_of: str | None = None
    budget_s: float = 600.0
    opt_in: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)


_PIPELINE_SETTINGS: dict[str, Any] = {
    "device": "cpu", "dtype": "float32", "seed": 7, "deterministic": True,
    "num_rollout": 4, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
    "rollout_max_response_len": 8, "rollout_temperature": 1.0, "engine_max_total_tokens": 2048,
    "reward_fn": "milepost.gate_runs:token_parity",
    "advantage_estimator": "grpo", "eps_clip": 0.2, "eps_clip_high": 0.28,
    "use_kl_loss": True, "kl_loss_coef": 0.01, "entropy_coef": 0.001,
    # Two optimizer steps per rollout: the second sees a ratio != 1, so clipping counts.
    "lr": 1e-3, "global_batch_size": 8, "save_interval": 0, "save_hf_at_end": False,
    "use_tensorboard": False, "eval_interval": 2, "eval_temperature": 0.0,
}
_PROMPTS = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3), (9, 9), (5, 2)]


def _prepare_pipeline(work: Path) -> list[str]:
    from milepost.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(work / "model", "qwen3", seed=3)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in _PROMPTS]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    argv = ["--hf-checkpoint", str(work / "model"), "--prompt-data", str(work / "prompts.jsonl"),
            "--eval-prompt-data", str(work / "eval.jsonl"), "--run-dir", str(work / "run")]
    for key, value in _PIPELINE_SETTINGS.items():
        argv += [f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def _prepare_tiny_demo_proxy(work: Path) -> list[str]:
    # The demo's base model: built once (reused when `work` holds it) under the pinned kernels
    # too, so it is bitwise the same on any AVX2 processor for the same torch build. Unpinned,
    # seed 0 builds another model per processor type (docs/testing.md, "The demo's base model").
    demo = work / "demo-pinned"
    subprocess.run([sys.executable, "-m", "milepost.demo.prepare", str(demo)], check=True,
                   env={**os.environ, **PINNED_KERNELS})
    return [str(ROOT / "recipes" / "tiny_demo.toml"), "--hf-checkpoint", str(demo / "base_model"),
            "--prompt-data", str(demo / "rl_prompts.jsonl"),
            "--eval-prompt-data", str(demo / "eval_prompts.jsonl"), "--run-dir", str(work / "run"),
            "--num-rollout", "5", "--save-hf-at-end", "false", "--deterministic", "true"]


RUNS: dict[str, GateRun] = {r.name: r for r in (
    GateRun("pipeline", "4 deterministic GRPO steps (KL and entropy terms, 2 optimizer steps each, "
            "evaluation every 2) of a tiny random Qwen3 with a token-parity reward",
            _prepare_pipeline, budget_s=300.0),
    GateRun("tiny_demo_proxy", "recipes/tiny_demo.toml itself scaled down to its first 5 of 40 "
            "rollouts (the reward's rise; the greedy held-out evaluation after the 5th), "
            "deterministic, on the base model `python -m milepost.demo.prepare` builds (minutes)",
            _prepare_tiny_demo_proxy, proxy_of="recipes/tiny_demo.toml", budget_s=3600.0, opt_in=True),
)}


def run_fresh(run: GateRun, work: Path, extra_args: list[str] | None = None) -> list[dict[str, Any]]:
    """Run `run` in `work` (plus `extra_args` for `milepost train`, e.g. a perturbation) and return
    its metrics.jsonl records. Engines and trainer get one thread each (OMP_NUM_THREADS=1) and
    the pinned kernels (PINNED_KERNELS)."""
    _require_avx2()
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "run", ignore_errors=True)  # a reused work dir: never resume an old run
    argv = run.prepare(work) + list(extra_args or [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **PINNED_KERNELS,
           **run.extra_env}
    log = work / "train.log"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "milepost", "train", *argv], env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=run.budget_s, check=False)
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(True)[-30:])
        raise RuntimeError(f"gate run {run.name!r} failed (exit {done.returncode}); log {log}:\n{tail}")
    metrics = work / "run" / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _require_avx2() -> None:
    """The pinned kernels need an x86-64 processor with AVX2; elsewhere the standards cannot hold."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
    if " avx2" not in flags or " fma" not in flags:
        raise RuntimeError("the metric gate's standards are bit for bit with torch, MKL and oneDNN held "
                           "to their AVX2 kernels (milepost/gate_runs.py PINNED_KERNELS); this "
                           "machine reports no AVX2/FMA in /proc/cpuinfo: run the gate on an x86-64 "
                           "machine that has them")
