"""Metrics of a run: JSONL always (`run_dir/metrics.jsonl`, one line per step), TensorBoard and
W&B (offline mode) when asked. Names follow the report's panels; a driver may log more names.

| name | meaning |
| --- | --- |
| rollout/reward_mean | mean reward of the step's samples |
| rollout/reward_std | std of those rewards |
| rollout/response_len_mean | mean response length in tokens |
| rollout/truncated_frac | share of samples cut by rollout_max_response_len |
| rollout/prefix_cache_hit_rate | prompt tokens served from the engines' prefix cache / prompt tokens |
| rollout/tokens_per_s | generated tokens / rollout wall time |
| rollout/spec_accept_length | speculating engines: tokens per verify step (1 + accepted proposals) |
| rollout/spec_accept_rate | speculating engines: accepted / proposed draft tokens |
| train/loss | total loss (policy gradient + KL + entropy terms), mean over optimizer steps |
| train/pg_clipfrac | share of response tokens whose ratio was clipped |
| train/kl | KL to the reference policy (the configured estimator) |
| train/entropy | mean token entropy of the policy |
| train/grad_norm | global gradient norm before clipping |
| train/lr | learning rate of the last optimizer step |
| train/train_rollout_logprob_abs_diff | mean abs(trainer log-prob - engine log-prob) per token |
| perf/rollout_time | seconds generating (and scoring) the step's samples |
| perf/train_time | seconds in the trainer |
| perf/update_weights_time | seconds moving weights to the engines |
| perf/step_time | seconds of the whole step |
| eval/reward_mean | mean reward on eval prompts (steps that evaluate) |
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
METRICS: dict[str, str] = {
    line.split("|")[1].strip(): line.split("|")[2].strip()
    for line in (__doc__ or "").splitlines()
    if line.startswith("| ") and "/" in line.split("|")[1]
}


def _parse_lines(text: str) -> tuple[list[dict[str, Any]], bool]:
    """(records, clean): records of the well-formed lines; clean is False if any line was not."""
    records, clean = [], text == "" or text.endswith("\n")
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            int(rec["step"])
        except (ValueError, KeyError, TypeError):
            clean = False  # a line torn by a crash; dropped
            continue
        records.append(rec)
    return records, clean


def read_metrics(path: Path | str) -> list[dict[str, float]]:
    """The records of a metrics.jsonl (or of the run directory holding it), in file order.

    Each record has "step" (int), "time" (unix seconds) and its metrics; null values read as NaN.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a run directory that holds {METRICS_FILE}")
    records, _ = _parse_lines(path.read_text())
    return [{k: (math.nan if v is None else v) for k, v in rec.items()} for rec in records]


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no NaN / Infinity


class MetricsLogger:
    """`with MetricsLogger(run_dir, tensorboard=..., wandb=...) as m: m.log(step, {...})`.

    Resuming: lines already in metrics.jsonl are kept, and a step already there is not logged again
    (`log` returns False). A run that restarts from a checkpoint passes `start_step`, the first step
    it will run: lines at or after it, logged before the stop and now redone, are dropped first.
    """

    def __init__(
        self,
        run_dir: Path | str,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str | None = "milepost",
        start_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._previous = self._recover(start_step)
        self._last_step: int | None = None
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            self._tb = self._open_tensorboard(start_step)
        if wandb:
            self._wandb = self._open_wandb(wandb_project or "milepost")
        self._file = self.path.open("a", encoding="utf-8")

    def _recover(self, start_step: int | None) -> set[int]:
        """Steps already logged; rewrites the file without torn lines and without redone steps."""
        if not self.path.exists():
            return set()
        records, clean = _parse_lines(self.path.read_text(encoding="utf-8"))
        kept = [r for r in records if start_step is None or int(r["step"]) < start_step]
        if not clean or len(kept) != len(records):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.path)
            log.info("metrics: kept %d of %d earlier lines of %s", len(kept), len(records), self.path)
        return {int(r["step"]) for r in kept}

    def _open_tensorboard(self, start_step: int | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                f"--use-tensorboard needs the tensorboard package ({err}); pip install tensorboard"
            ) from err
        # purge_step hides events a crashed run logged at steps that are now redone.
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start_step)

    def _open_wandb(self, project: str) -> Any:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "--use-wandb needs the wandb package: pip install wandb "
                "(milepost runs it in offline mode; sync later with `wandb sync`)"
            ) from err
        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id)
        return wandb.init(project=project, dir=str(self.run_dir), id=run_id, resume="allow", mode="offline")

    def log(self, step: int, metrics: dict[str, float]) -> bool:
        """Record one step's metrics (all of them in one call); False if that step was logged before."""
        step = int(step)
        if step in self._previous:
            log.debug("metrics: step %d is already in %s; not logged again", step, self.path)
            return False
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"metrics: step {step} comes after step {self._last_step}; steps must "
                "increase, and one step's metrics go in one log() call"
            )
        values = {str(k): float(v) for k, v in metrics.items()}
        if {"step", "time"} & values.keys():
            raise ValueError("metrics: 'step' and 'time' are reserved names; rename the metric")
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: _finite_or_none(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._last_step = step
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        return True

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
