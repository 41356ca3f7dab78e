"""A progress bar over RL steps showing the reward mean and the step time.

On a terminal it is a rich live bar; otherwise (logs, CI, pipes) it prints one plain line per step.
"""

from __future__ import annotations

import math
import sys
import time
from types import TracebackType
from typing import IO, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Shown on the plain line after reward and step time, when present.
_PLAIN_EXTRA = ("train/loss", "train/kl", "rollout/response_len_mean")


def _fmt(value: Any, spec: str) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "-"
    return "-" if math.isnan(v) else format(v, spec)


class StepProgress:
    """`with StepProgress(total=cfg.num_rollout, start=first_step) as bar: ... bar.update(step, m)`.

    Steps count from 0; `update(step, metrics)` marks `step` done (the bar shows step + 1 of total).
    `plain=None` picks the live bar on a terminal and plain lines elsewhere.
    """

    def __init__(
        self, total: int, *, start: int = 0, stream: IO[str] | None = None, plain: bool | None = None
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        console = Console(file=self.stream)
        self.plain = (not console.is_terminal) if plain is None else plain
        self._progress: Progress | None = None
        self._task: Any = None
        self._start = start
        if not self.plain:
            self._progress = Progress(
                TextColumn("[bold]step"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("step {task.fields[step_time]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )

    def __enter__(self) -> StepProgress:
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task(
                "steps", total=self.total, completed=self._start, reward="-", step_time="-"
            )
        return self

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` (from 0) finished with these metrics."""
        reward = _fmt(metrics.get("rollout/reward_mean"), ".4f")
        step_time = _fmt(metrics.get("perf/step_time"), ".2f")
        step_time += "s" if step_time != "-" else ""
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, reward=reward, step_time=step_time)
            return
        extra = "".join(
            f" {name.split('/')[-1]}={_fmt(metrics[name], '.4g')}" for name in _PLAIN_EXTRA if name in metrics
        )
        stamp = time.strftime("%H:%M:%S")
        print(
            f"{stamp} step {step + 1}/{self.total} reward_mean={reward} step_time={step_time}{extra}",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
