"""`milepost report RUN_DIR`: plots of a run's metrics.jsonl (PNG) and a summary.md.

Plots: reward (mean ± std, eval), response length (and truncated share), stability (KL, clip
fraction, entropy, train-rollout log-prob gap), optimizer (loss, grad norm, lr), and the time
split per step (stacked). A plot whose metrics were never logged is skipped.
"""

from __future__ import annotations

import math
from pathlib import Path

from milepost.observe.metrics import read_metrics

# Direction of "best" in the summary; metrics in neither set show no best.
_HIGHER_IS_BETTER = {
    "rollout/reward_mean",
    "eval/reward_mean",
    "rollout/tokens_per_s",
    "rollout/prefix_cache_hit_rate",
}
_LOWER_IS_BETTER = {
    "rollout/truncated_frac",
    "train/train_rollout_logprob_abs_diff",
    "perf/rollout_time",
    "perf/train_time",
    "perf/update_weights_time",
    "perf/step_time",
}
_TIME_PARTS = ("perf/rollout_time", "perf/train_time", "perf/update_weights_time")


def _series(records: list[dict[str, float]], name: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[name])) for r in records if name in r and not math.isnan(float(r[name]))]
    return [s for s, _ in pts], [v for _, v in pts]


def _has(records: list[dict[str, float]], name: str) -> bool:
    return any(name in r and not math.isnan(float(r[name])) for r in records)


def _figure(rows: int = 1, height: float = 3.6):  # type: ignore[no-untyped-def]
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas on save
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, height * rows), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


def _plot_reward(records: list[dict[str, float]], path: Path) -> bool:
    if not _has(records, "rollout/reward_mean"):
        return False
    fig, (ax,) = _figure()
    steps, mean = _series(records, "rollout/reward_mean")
    ax.plot(steps, mean, label="rollout reward mean", color="C0")
    if _has(records, "rollout/reward_std"):
        by_step = dict(zip(*_series(records, "rollout/reward_std")))
        std = [by_step.get(s, math.nan) for s in steps]
        lo = [m - s for m, s in zip(mean, std)]
        hi = [m + s for m, s in zip(mean, std)]
        ax.fill_between(steps, lo, hi, alpha=0.2, color="C0", label="± std")
    if _has(records, "eval/reward_mean"):
        ax.plot(*_series(records, "eval/reward_mean"), "o-", color="C3", label="eval reward mean")
    ax.set_title("reward")
    ax.legend(loc="best")
    fig.savefig(path, dpi=100)
    return True


def _plot_response_len(records: list[dict[str, float]], path: Path) -> bool:
    if not _has(records, "rollout/response_len_mean"):
        return False
    fig, (ax,) = _figure()
    ax.plot(*_series(records, "rollout/response_len_mean"), color="C0", label="response length mean")
    ax.set_ylabel("tokens")
    ax.set_title("response length")
    if _has(records, "rollout/truncated_frac"):
        twin = ax.twinx()
        twin.plot(*_series(records, "rollout/truncated_frac"), color="C1", label="truncated share")
        twin.set_ylabel("truncated share")
        twin.set_ylim(0, 1)
        twin.legend(loc="upper right")
    ax.legend(loc="upper left")
    fig.savefig(path, dpi=100)
    return True


def _plot_panels(records: list[dict[str, float]], names: tuple[str, ...], title: str, path: Path) -> bool:
    present = [n for n in names if _has(records, n)]
    if not present:
        return False
    fig, axes = _figure(len(present), height=2.4)
    for ax, name in zip(axes, present):
        ax.plot(*_series(records, name))
        ax.set_ylabel(name.split("/")[-1])
    axes[0].set_title(title)
    fig.savefig(path, dpi=100)
    return True


def _plot_time_split(records: list[dict[str, float]], path: Path) -> bool:
    parts = [n for n in _TIME_PARTS if _has(records, n)]
    if not parts:
        return False

    def val(r: dict[str, float], name: str) -> float:
        v = float(r.get(name, 0.0))
        return 0.0 if math.isnan(v) else v

    steps = [int(r["step"]) for r in records]
    ys = [[val(r, n) for r in records] for n in parts]
    labels = [n.removeprefix("perf/").removesuffix("_time") for n in parts]
    if _has(records, "perf/step_time"):  # what the parts do not cover: data, rewards, logging ...
        ys.append([max(val(r, "perf/step_time") - sum(val(r, n) for n in parts), 0.0) for r in records])
        labels.append("other")
    fig, (ax,) = _figure()
    ax.stackplot(steps, ys, labels=labels, alpha=0.85)
    ax.set_ylabel("seconds")
    ax.set_title("time per step")
    ax.legend(loc="upper left")
    fig.savefig(path, dpi=100)
    return True


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.6g}"


def _summary(records: list[dict[str, float]], run_dir: Path, images: list[Path]) -> str:
    names = sorted({k for r in records for k in r} - {"step", "time"})
    steps = [int(r["step"]) for r in records]
    lines = [
        f"# Run summary: {run_dir.name}",
        "",
        f"- run directory: `{run_dir}`",
        f"- steps logged: {len(records)} (step {min(steps)} to {max(steps)})",
    ]
    if _has(records, "perf/step_time"):
        total = sum(v for v in _series(records, "perf/step_time")[1] if not math.isnan(v))
        lines.append(f"- total step time: {total:.1f} s")
    lines += ["", "| metric | first | last | best | min | max |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        vals = [v for v in _series(records, name)[1] if not math.isnan(v)]
        if not vals:
            continue
        best = max(vals) if name in _HIGHER_IS_BETTER else min(vals) if name in _LOWER_IS_BETTER else None
        cells = [
            _fmt(vals[0]),
            _fmt(vals[-1]),
            "-" if best is None else _fmt(best),
            _fmt(min(vals)),
            _fmt(max(vals)),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write the plots and summary.md of `run_dir`'s metrics.jsonl into `out_dir` (default
    run_dir/report); returns the written paths (PNGs, then summary.md)."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no metrics yet; run some steps first")
    records.sort(key=lambda r: int(r["step"]))
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        ("reward.png", lambda p: _plot_reward(records, p)),
        ("response_len.png", lambda p: _plot_response_len(records, p)),
        (
            "stability.png",
            lambda p: _plot_panels(
                records,
                ("train/kl", "train/pg_clipfrac", "train/entropy", "train/train_rollout_logprob_abs_diff"),
                "stability",
                p,
            ),
        ),
        (
            "optimizer.png",
            lambda p: _plot_panels(records, ("train/loss", "train/grad_norm", "train/lr"), "optimizer", p),
        ),
        ("time_split.png", lambda p: _plot_time_split(records, p)),
    ]
    written = [out / name for name, plot in plots if plot(out / name)]
    from milepost.diffusion.grid import copy_grids

    written += copy_grids(run_dir, out)  # diffusion runs: the first and last step's images
    summary = out / "summary.md"
    summary.write_text(_summary(records, run_dir, written))
    return [*written, summary]
