"""Observability: metrics JSONL (and resume), TensorBoard, W&B error, progress, report and its CLI."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest

from milepost.cli import main
from milepost.observe.metrics import METRICS, MetricsLogger, read_metrics
from milepost.observe.progress import StepProgress
from milepost.observe.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _step_metrics(step: int) -> dict[str, float]:
    return {
        "rollout/reward_mean": 0.1 + 0.04 * step,
        "rollout/reward_std": 0.2,
        "rollout/response_len_mean": 50.0 + step,
        "rollout/truncated_frac": 0.05,
        "train/loss": 0.3 - 0.01 * step,
        "train/pg_clipfrac": 0.02,
        "train/kl": 0.001 * step,
        "train/entropy": 1.5,
        "train/grad_norm": 0.8,
        "train/lr": 1e-6,
        "train/train_rollout_logprob_abs_diff": 0.01,
        "perf/rollout_time": 2.0,
        "perf/train_time": 1.0,
        "perf/update_weights_time": 0.25,
        "perf/step_time": 3.5 + 0.1 * step,
    }


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_documented_names() -> None:
    for name in (
        "rollout/reward_mean",
        "rollout/prefix_cache_hit_rate",
        "rollout/tokens_per_s",
        "train/grad_norm",
        "train/train_rollout_logprob_abs_diff",
        "perf/update_weights_time",
        "perf/step_time",
    ):
        assert name in METRICS and METRICS[name]


def test_jsonl_written_and_flushed(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as m:
        assert m.log(0, {"rollout/reward_mean": 0.5, "train/kl": float("nan")})
        # readable before close: each line is flushed
        (rec,) = read_metrics(tmp_path)
        assert rec["step"] == 0 and rec["rollout/reward_mean"] == 0.5 and math.isnan(rec["train/kl"])
        assert '"train/kl": null' in (tmp_path / "metrics.jsonl").read_text()  # strict JSON
        m.log(1, {"rollout/reward_mean": 0.6})
        with pytest.raises(ValueError, match="steps must increase"):
            m.log(1, {"train/loss": 1.0})
        with pytest.raises(ValueError, match="reserved"):
            m.log(2, {"step": 1.0})
    assert _steps(tmp_path) == [0, 1]


def test_resume_appends_without_duplicate_steps(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as m:
        for step in range(3):
            m.log(step, {"rollout/reward_mean": float(step)})
    with MetricsLogger(tmp_path) as m:  # a resumed run replays steps 1-2, then goes on
        assert not m.log(1, {"rollout/reward_mean": 99.0})
        assert not m.log(2, {"rollout/reward_mean": 99.0})
        assert m.log(3, {"rollout/reward_mean": 3.0})
    assert _steps(tmp_path) == [0, 1, 2, 3]
    assert [r["rollout/reward_mean"] for r in read_metrics(tmp_path)] == [0.0, 1.0, 2.0, 3.0]


def test_restart_from_checkpoint_redoes_later_steps(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as m:
        for step in range(5):
            m.log(step, {"rollout/reward_mean": float(step)})
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 5, "rollo')  # a line torn by a crash
    with MetricsLogger(tmp_path, start_step=3) as m:  # the checkpoint was after step 2
        assert m.log(3, {"rollout/reward_mean": 30.0})
    assert _steps(tmp_path) == [0, 1, 2, 3]
    assert read_metrics(tmp_path)[-1]["rollout/reward_mean"] == 30.0


def test_tensorboard_event_file(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as m:
        m.log(0, {"rollout/reward_mean": 0.25})
        m.log(1, {"rollout/reward_mean": 0.75})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(0, 0.25), (1, 0.75)]


def test_wandb_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="--use-wandb needs the wandb package: pip install wandb"):
        MetricsLogger(tmp_path, wandb=True)


def test_progress_plain_lines() -> None:
    out = io.StringIO()  # not a terminal: plain lines
    with StepProgress(3, stream=out) as bar:
        assert bar.plain
        bar.update(0, {"rollout/reward_mean": 0.5, "perf/step_time": 1.234, "train/loss": 0.1})
        bar.update(1, {})
    lines = out.getvalue().splitlines()
    assert "step 1/3 reward_mean=0.5000 step_time=1.23s loss=0.1" in lines[0]
    assert "step 2/3 reward_mean=- step_time=-" in lines[1]


def test_progress_bar() -> None:
    out = io.StringIO()
    with StepProgress(2, stream=out, plain=False) as bar:
        bar.update(0, {"rollout/reward_mean": 0.5, "perf/step_time": 1.0})
        bar.update(1, {"rollout/reward_mean": 0.75, "perf/step_time": 1.0})
    assert "2/2" in out.getvalue() and "reward 0.7500" in out.getvalue()


def test_report_writes_plots_and_summary(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as m:
        for step in range(6):
            m.log(step, _step_metrics(step))
    paths = write_report(tmp_path, tmp_path / "out")
    names = [p.name for p in paths]
    assert names == [
        "reward.png",
        "response_len.png",
        "stability.png",
        "optimizer.png",
        "time_split.png",
        "summary.md",
    ]
    for p in paths[:-1]:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000
    summary = paths[-1].read_text()
    # first 0.1, last 0.3, best (max) 0.3 of the reward; best step time is the lowest
    assert "| rollout/reward_mean | 0.1 | 0.3 | 0.3 | 0.1 | 0.3 |" in summary
    assert "| perf/step_time | 3.5 | 4 | 3.5 | 3.5 | 4 |" in summary
    assert "steps logged: 6 (step 0 to 5)" in summary


def test_report_skips_missing_metrics_and_refuses_empty(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)
    with MetricsLogger(tmp_path) as m:
        pass
    with pytest.raises(ValueError, match="holds no metrics"):
        write_report(tmp_path)
    with MetricsLogger(tmp_path) as m:
        m.log(0, {"rollout/reward_mean": 1.0})
        m.log(1, {"rollout/reward_mean": 0.0})
    assert [p.name for p in write_report(tmp_path)] == ["reward.png", "summary.md"]
    assert (tmp_path / "report" / "reward.png").is_file()


def test_report_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with MetricsLogger(run) as m:
        for step in range(3):
            m.log(step, _step_metrics(step))
    assert main(["report", str(run), "--out", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "plots" / "summary.md") in printed and len(printed) == 6
    assert all(Path(p).is_file() for p in printed)
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "nothing")])
    assert exit_.value.code == 2 and "metrics.jsonl" in capsys.readouterr().err
