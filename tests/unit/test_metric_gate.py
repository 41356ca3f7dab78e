"""The metric gate's comparison: bit for bit where a metric is exact (one ulp is a failure, which is
what a changed accumulation order leaves), within its band where banded, and a readable diff.
The real runs (a perturbed loss coefficient and sampler seed) are in tests/e2e/test_metric_gate_live.py."""

from __future__ import annotations

import math
from pathlib import Path

from milepost.gate_runs import RUNS, registrable
from milepost.metric_gate import (
    Standard,
    compare,
    format_diff,
    read_standard,
    registered_steps,
    standard_path,
    standard_paths,
    write_standard,
)

RECORDS = [
    {"step": 0, "time": 1.0, "train/loss": 0.125, "rollout/reward_mean": 0.5,
     "train/train_rollout_logprob_abs_diff": 3e-7, "perf/step_time": 2.0},
    {"step": 1, "time": 2.0, "train/loss": 0.0625, "rollout/reward_mean": 0.75,
     "train/train_rollout_logprob_abs_diff": 2e-7, "perf/step_time": 3.0, "eval/reward_mean": 1.0},
]
NAMES = ["eval/reward_mean", "rollout/reward_mean", "train/loss", "train/train_rollout_logprob_abs_diff"]


def _standard() -> Standard:
    header = {"standard": "t", "exact": NAMES[:3], "bands": {NAMES[3]: 1e-6}}
    return Standard(header, registered_steps(RECORDS, NAMES))


def _with(step: int, **values: float) -> list[dict]:
    out = [dict(r) for r in RECORDS]
    out[step].update({k.replace("__", "/"): v for k, v in values.items()})
    return out


def test_timings_are_not_registered() -> None:
    assert sorted(n for n in RECORDS[1] if registrable(n)) == NAMES


def test_an_identical_run_passes_and_timings_may_differ() -> None:
    assert compare(_standard(), _with(1, perf__step_time=99.0, time=5.0)) == []


def test_one_ulp_fails_bit_for_bit() -> None:
    nudged = math.nextafter(0.0625, 1.0)
    diffs = compare(_standard(), _with(1, train__loss=nudged))
    assert [(d.step, d.metric, d.allowed) for d in diffs] == [(1, "train/loss", "bit for bit")]
    text = format_diff("t", diffs)
    assert "train/loss" in text and "0.0625" in text and "first differing step: 1" in text


def test_a_band_holds_and_breaks() -> None:
    assert compare(_standard(), _with(0, train__train_rollout_logprob_abs_diff=9e-7)) == []
    diffs = compare(_standard(), _with(0, train__train_rollout_logprob_abs_diff=3e-5))
    assert [(d.metric, d.allowed) for d in diffs] == [(NAMES[3], "± 1e-06")]


def test_missing_metrics_and_steps_are_named() -> None:
    short = [dict(RECORDS[0])]
    diffs = compare(_standard(), short)
    assert [(d.metric, d.standard, d.fresh) for d in diffs] == [("steps", [0, 1], [0])]
    unlogged = [dict(RECORDS[0]), {k: v for k, v in RECORDS[1].items() if k != "train/loss"}]
    assert [(d.metric, d.fresh) for d in compare(_standard(), unlogged)] == [("train/loss", "missing")]


def test_standard_file_round_trips_floats_exactly(tmp_path: Path) -> None:
    odd = 0.1 + 0.2  # 0.30000000000000004: the shortest repr round-trips bit for bit
    std = Standard({"standard": "t", "exact": ["x"]}, [{"step": 0, "x": odd}])
    write_standard(tmp_path / "t.jsonl", std)
    assert read_standard(tmp_path / "t.jsonl").steps[0]["x"] == odd


def test_the_ci_standard_is_committed_and_registers_the_loss() -> None:
    std = read_standard(standard_path("pipeline"))
    assert not RUNS["pipeline"].opt_in
    assert {"train/loss", "rollout/reward_mean", "train/kl", "eval/reward_mean"} <= set(std.exact)
    assert len(std.steps) == 4 and all("train/loss" in s for s in std.steps)


def _run_flags(tmp_path: Path) -> list[str]:
    import json

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "p.jsonl"),
            "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--num-rollout", "2",
            "--rollout-batch-size", "2"]


def test_deterministic_mode_settings(tmp_path: Path) -> None:
    import pytest

    from milepost.config import ConfigError, load_config
    from milepost.rollout.generate import request_seed

    flags = _run_flags(tmp_path)
    assert load_config(None, [*flags, "--deterministic"]).trainer_cpu_threads == 1
    assert load_config(None, [*flags, "--deterministic", "--trainer-cpu-threads", "2"]).trainer_cpu_threads == 2
    assert load_config(None, flags).trainer_cpu_threads is None
    with pytest.raises(ConfigError, match="--deterministic needs the synchronous loop"):
        load_config(None, [*flags, "--deterministic", "--fully-async"])
    # Each (group, sample) of a run gets its own seed, and another --seed gives other seeds.
    seeds = {request_seed(7, g, k) for g in range(64) for k in range(16)}
    assert len(seeds) == 64 * 16 and request_seed(8, 0, 0) not in seeds


def test_another_vendors_standard_holds_floats_within_the_cross_vendor_tolerance() -> None:
    """An AMD EPYC and an Intel Xeon differ by ~1e-7 even with the kernels pinned to AVX2: a machine
    whose vendor has no standard is held to another vendor's within CROSS_VENDOR, integral values
    (counts, rewards of whole samples) still exactly."""
    near = 0.0625 * (1 + 4e-6)
    assert compare(_standard(), _with(1, train__loss=near)) != []
    assert compare(_standard(), _with(1, train__loss=near), cross_vendor=True) == []
    far = compare(_standard(), _with(1, train__loss=0.0625 * 1.001), cross_vendor=True)
    assert [(d.metric, d.allowed) for d in far] == [("train/loss", "another CPU vendor's, ± 1e-6 + 1e-5·|x|")]
    assert compare(_standard(), _with(1, eval__reward_mean=1.0000001), cross_vendor=True) != []


def test_each_cpu_vendor_gets_its_own_standard(tmp_path: Path, monkeypatch) -> None:
    import milepost.metric_gate as gate

    monkeypatch.setattr(gate, "HISTORY", tmp_path)
    intel = Standard({**_standard().header, "cpu_vendor": "GenuineIntel"}, _standard().steps)
    write_standard(tmp_path / "t.jsonl", intel)
    assert gate.standard_path("t", "GenuineIntel") == tmp_path / "t.jsonl"
    assert gate.standard_path("t", "AuthenticAMD") == tmp_path / "t.AuthenticAMD.jsonl"
    monkeypatch.setattr(gate, "cpu_vendor", lambda: "AuthenticAMD")
    assert gate._chosen("t") == (tmp_path / "t.jsonl", True)  # none of its own yet: Intel's, near
    write_standard(tmp_path / "t.AuthenticAMD.jsonl", intel)
    assert gate._chosen("t") == (tmp_path / "t.AuthenticAMD.jsonl", False)
    assert gate.standard_paths("t") == [tmp_path / "t.jsonl", tmp_path / "t.AuthenticAMD.jsonl"]


def test_the_ci_standard_exists_for_both_vendors_seen_here() -> None:
    vendors = {read_standard(p).header.get("cpu_vendor") for p in standard_paths("pipeline")}
    assert {"GenuineIntel", "AuthenticAMD"} <= vendors
