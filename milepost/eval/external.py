"""Asynchronous evaluation by an external backend (report 2.2.4, table 3, "External").

The trainer exports a snapshot (a Hugging Face directory) and hands it to a user backend chosen by
import path, `Class().evaluate(checkpoint_dir, prompt_data, step) -> {name: number}`, which runs
on a background thread while training goes on. A score is recorded against the step whose
weights it measured, with how late it arrived (`RUN_DIR/eval_async.jsonl`). Failures never stop
training: an export that failed, a snapshot that is missing, too many evaluations outstanding, or
an error inside the backend is recorded as skipped with the reason.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)
RECORDS_FILE = "eval_async.jsonl"


class EvalSkipped(RuntimeError):
    """Raised by a backend that knows why its score must not count (e.g. a version check)."""


class EvalBackend(Protocol):
    def evaluate(self, checkpoint_dir: Path, prompt_data: Path, step: int) -> dict[str, float]: ...


@dataclass
class EvalRecord:
    """step: the step whose weights (version step + 1) were measured; reported_at_step: the step
    being trained when the result came in."""

    step: int
    reported_at_step: int
    delay_steps: int
    delay_s: float
    metrics: dict[str, float] = field(default_factory=dict)
    skipped_reason: str | None = None


def snapshot_problem(path: Path) -> str | None:
    """Why `path` is not a usable snapshot, or None."""
    if not (path / "config.json").is_file():
        return f"snapshot missing: {path} has no config.json"
    if not any(path.glob("*.safetensors")):
        return f"snapshot missing: {path} has no safetensors weights"
    return None


class ExternalEvaluator:
    """Runs evaluations on up to `max_outstanding` background threads; rank 0 only."""

    def __init__(self, backend: EvalBackend, prompt_data: Path, run_dir: Path,
                 max_outstanding: int) -> None:
        self.backend = backend
        self.prompt_data = prompt_data
        self.max_outstanding = max_outstanding
        self.records_path = Path(run_dir) / RECORDS_FILE
        self._pool = ThreadPoolExecutor(max_outstanding, thread_name_prefix="external-eval")
        self._running: dict[int, tuple[Future, float]] = {}  # step -> (future, submitted at)
        self._lock = threading.Lock()
        self.counts = {"submitted": 0, "done": 0, "skipped": 0}

    @property
    def outstanding(self) -> int:
        return len(self._running)

    def has_room(self) -> bool:
        return self.outstanding < self.max_outstanding

    def submit(self, step: int, snapshot: Path) -> None:
        problem = snapshot_problem(snapshot)
        if problem is not None:
            self.skip(step, step, problem)
            return
        self.counts["submitted"] += 1
        future = self._pool.submit(self.backend.evaluate, snapshot, self.prompt_data, step)
        self._running[step] = (future, time.monotonic())

    def skip(self, step: int, now_step: int, reason: str) -> None:
        log.warning("evaluation of step %d skipped: %s", step, reason)
        self._write(EvalRecord(step, now_step, now_step - step, 0.0, skipped_reason=reason))

    def collect(self, now_step: int, wait_s: float = 0.0) -> dict[str, float]:
        """Record the evaluations that finished (waiting up to wait_s for the rest); the
        step's `eval/external_*` numbers."""
        deadline = time.monotonic() + wait_s
        for step, (future, t0) in sorted(self._running.items()):
            try:
                result = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                continue
            except EvalSkipped as e:
                del self._running[step]
                self.skip(step, now_step, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - a user's backend may raise anything
                del self._running[step]
                self.skip(step, now_step, f"backend error: {type(e).__name__}: {e}")
                continue
            del self._running[step]
            bad = self._check(result)
            if bad is not None:
                self.skip(step, now_step, bad)
                continue
            self.counts["done"] += 1
            self._write(EvalRecord(step, now_step, now_step - step, time.monotonic() - t0,
                                   metrics={k: float(v) for k, v in result.items()}))
        return {f"eval/external_{k}": float(v) for k, v in self.counts.items()} | {
            "eval/external_outstanding": float(self.outstanding)}

    @staticmethod
    def _check(result: Any) -> str | None:
        if not isinstance(result, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) for k, v in result.items()):
            return f"backend error: evaluate returned {result!r:.200}, not a dict of numbers"
        return None

    def _write(self, record: EvalRecord) -> None:
        if record.skipped_reason is not None:
            self.counts["skipped"] += 1
        with self._lock, open(self.records_path, "a") as f:
            f.write(json.dumps(asdict(record)) + "\n")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_backend(path: str) -> EvalBackend:
    """Instantiate the backend class at `path`; ValueError naming --eval-backend if it cannot be."""
    from milepost.plugins import load_callable

    cls = load_callable(path, "--eval-backend")
    try:
        backend = cls()
    except Exception as e:
        raise ValueError(f"--eval-backend {path}: {path}() raised {type(e).__name__}: {e}") from e
    if not callable(getattr(backend, "evaluate", None)):
        raise ValueError(f"--eval-backend {path}: the instance has no evaluate(checkpoint_dir, "  # noqa: TRY004
                         "prompt_data, step) method")
    return backend
