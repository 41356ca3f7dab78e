"""Settings of fully asynchronous RL: defaults under --fully-async and the refusals at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.testing.run_args import stub_run_args


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    return stub_run_args(tmp_path, "--device", "cpu", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2")


def test_defaults_under_fully_async(base: list[str]) -> None:
    cfg = load_config(None, [*base, "--fully-async"])
    assert cfg.max_inflight == 8 and cfg.rollout_granularity == "sample"
    assert cfg.pause_generation_mode == "retract" and cfg.max_staleness is None
    sync = load_config(None, base)
    assert sync.max_inflight is None and sync.rollout_granularity is None


@pytest.mark.parametrize("flags, message", [
    (["--colocate"], "refused with --colocate"),
    (["--max-staleness", "-1"], "--max-staleness -1 is negative"),
    (["--buffer-capacity-factor", "0.5"], "smaller than one train batch"),
    (["--max-inflight", "1"], "--max-inflight 1 is below --n-samples-per-prompt 2"),
    (["--buffer-class", "not an import path"], "is not an import path"),
    (["--rollout-only"], "cannot be used with --load-rollouts or --rollout-only"),
])
def test_invalid_fully_async_settings_are_refused(base: list[str], flags: list[str],
                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("-", "\\-")):
        load_config(None, [*base, "--fully-async", *flags])


def test_fully_async_settings_without_fully_async_are_refused(base: list[str]) -> None:
    with pytest.raises(ConfigError, match="--max-staleness only applies to --fully-async"):
        load_config(None, [*base, "--max-staleness", "1"])
