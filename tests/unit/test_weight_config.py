"""Weight-update settings: transfer modes, disk-delta's refusals and defaults, the equality check."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.config import ConfigError, TrainConfig, load_config
from milepost.testing.run_args import stub_run_args


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    return stub_run_args(tmp_path, "--num-rollout", "3", "--rollout-batch-size", "4", "--device", "cpu")


@pytest.mark.parametrize("mode", ["tensor", "broadcast", "p2p", "disk-delta"])
def test_every_transfer_mode_is_accepted(base, mode) -> None:
    assert load_config(None, base + ["--update-weight-transfer-mode", mode]
                       ).update_weight_transfer_mode == mode


def test_disk_delta_defaults_its_store_under_the_run_dir(base, tmp_path) -> None:
    cfg = load_config(None, base + ["--update-weight-transfer-mode", "disk-delta"])
    assert cfg.update_weight_delta_dir == (tmp_path / "run" / "weight_deltas").absolute()
    assert cfg.update_weight_delta_encoding == "xor"


@pytest.mark.parametrize("extra, needle", [
    (["--colocate", "--update-weight-transfer-mode", "disk-delta"], "--colocate moves weights"),
    (["--colocate", "--update-weight-transfer-mode", "p2p"], "--colocate moves weights"),
    (["--update-weight-delta-encoding", "overwrite"], "only apply to --update-weight-transfer-mode"),
    (["--check-weight-update-equal-skip", "*.k_scale"], "without --check-weight-update-equal"),
    (["--update-weight-transfer-mode", "rdma"], "update-weight-transfer-mode"),
])
def test_invalid_weight_settings_are_refused_at_start(base, extra, needle) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, base + extra)
    assert needle in str(err.value)


def test_abort_pause_is_refused_with_the_session_server(base) -> None:
    if "use_session_server" not in TrainConfig.model_fields:
        pytest.skip("the session server's flag is not in this tree")
    with pytest.raises(ConfigError, match="abort"):
        load_config(None, base + ["--use-session-server", "--session-model-family", "qwen3",
                                  "--pause-generation-mode", "abort"])


def test_equality_check_with_skip_list(base) -> None:
    cfg = load_config(None, base + ["--check-weight-update-equal",
                                    "--check-weight-update-equal-skip", '["*.k_scale"]'])
    assert cfg.check_weight_update_equal and cfg.check_weight_update_equal_skip == ["*.k_scale"]


@pytest.mark.parametrize("mode", ["broadcast", "p2p", "disk-delta"])
def test_every_trainer_rank_sends_under_p2p_only(base, mode) -> None:
    """Under p2p each of 3 trainer ranks is a source for the engines the plan gives it; under
    the other modes only rank 0 has a transport."""
    from milepost.weights.factory import make_weight_sync

    cfg = load_config(None, base + ["--update-weight-transfer-mode", mode])
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    syncs = [make_weight_sync(cfg, urls, rank, 3) for rank in range(3)]
    try:
        assert syncs[0] is not None and syncs[0].transport.engine_urls == urls
        if mode != "p2p":
            assert syncs[1] is None and syncs[2] is None
            return
        assert [s.transport.targets for s in syncs] == [[0, 3], [1], [2]]
        assert [s.transport.coordinates for s in syncs] == [True, False, False]
    finally:
        for s in syncs:
            if s is not None:
                s.close()


def test_engine_quantization_reaches_embedded_engines_only(base) -> None:
    assert load_config(None, base + ["--engine-quantization", "fp8"]).engine_quantization == "fp8"
    assert load_config(None, base + ["--sglang-quantization", "fp8"]).engine_quantization == "fp8"
    from milepost.launch.local import LocalLauncher

    cfg = load_config(None, base + ["--engine-quantization", "fp8"])
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(30000)
    assert cmd[cmd.index("--quantization") + 1] == "fp8"
    assert "--quantization" not in LocalLauncher(load_config(None, base), cfg.run_dir)._engine_cmd(1)
    with pytest.raises(ConfigError, match="--engine-quantization fp8 is milepost's engine storage"):
        load_config(None, base + ["--engine-quantization", "fp8", "--engine-backend", "external",
                                  "--engine-urls", "http://127.0.0.1:1"])
