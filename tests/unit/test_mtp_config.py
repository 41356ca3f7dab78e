"""Run settings of the MTP draft: `--enable-mtp-training`, `--mtp-loss-scaling-factor` reach the
trainer; `--sglang-speculative-*` reach the engines' command line; what cannot work is refused
at start, naming the setting and the fix (a checkpoint without MTP layers, LoRA, Megatron,
external engines, a tree of proposals)."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.driver.trainer_settings import trainer_settings
from milepost.launch.local import LocalLauncher
from milepost.testing.hf_archs import make_tiny_hf_checkpoint
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_cfg")
    return {"mtp": make_tiny_mtp_checkpoint(root / "mtp", vocab_size=32),
            "plain": make_tiny_hf_checkpoint(root / "plain", "deepseek_v3", vocab_size=32)}


def flags(ckpt: Path, tmp_path: Path, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(ckpt), "--prompt-data", str(prompts), "--num-rollout", "1",
            "--rollout-batch-size", "4", "--device", "cpu", "--run-dir", str(tmp_path / "run"), *extra]


def test_settings_reach_the_trainer_and_the_engines(ckpts, tmp_path) -> None:
    cfg = load_config(None, flags(ckpts["mtp"], tmp_path, "--enable-mtp-training", "--mtp-loss-scaling-factor",
                                  "0.3", "--sglang-speculative-algorithm", "NEXTN",
                                  "--sglang-speculative-num-steps", "2", "--sglang-speculative-eagle-topk", "1"))
    s = trainer_settings(cfg)
    assert s.enable_mtp_training and s.mtp_loss_scaling_factor == 0.3
    cmd = LocalLauncher(cfg, tmp_path)._engine_cmd(1234)
    at = cmd.index("--speculative-algorithm")
    assert cmd[at + 1] == "NEXTN"
    assert cmd[cmd.index("--speculative-num-steps") + 1] == "2"
    assert "--speculative-num-draft-tokens" not in cmd  # the engine derives it: num_steps + 1


@pytest.mark.parametrize(("extra", "match"), [
    (("--enable-mtp-training",), "enable-mtp-training needs the checkpoint's multi-token-prediction "
                                 "layers.*no model.layers.3.*drop --enable-mtp-training"),
    (("--sglang-speculative-algorithm", "NEXTN"), "engine-speculative-algorithm NEXTN needs the "
                                                   "checkpoint's multi-token-prediction layers"),
])
def test_a_checkpoint_without_mtp_layers_is_refused(ckpts, tmp_path, extra, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, flags(ckpts["plain"], tmp_path, *extra))


@pytest.mark.parametrize(("extra", "match"), [
    (("--enable-mtp-training", "--lora-rank", "8"), "with --lora-rank.*drop one"),
    (("--sglang-speculative-num-steps", "2"), "needs --engine-speculative-algorithm"),
    (("--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-eagle-topk", "4"), "only 1"),
    (("--sglang-speculative-algorithm", "NGRAM", "--sglang-speculative-num-steps", "2"),
     "with NGRAM use --engine-speculative-num-draft-tokens"),
    (("--sglang-speculative-ngram-scope", "engine"), "is an NGRAM setting.*no speculation"),
])
def test_settings_that_cannot_work_are_refused(ckpts, tmp_path, extra, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, flags(ckpts["mtp"], tmp_path, *extra))


def test_the_weight_check_can_point_at_the_target_the_draft_or_both(ckpts, tmp_path) -> None:
    from milepost.weights.factory import selector_skips
    from milepost.weights.verify import _skipped

    names = ["model.layers.0.self_attn.o_proj.weight", "model.layers.3.eh_proj.weight",
             "model.layers.3.mlp.experts.1.up_proj.weight"]
    checked = {}
    for selector in ("all", "target", "draft"):
        cfg = load_config(None, flags(ckpts["mtp"], tmp_path, "--check-weight-update-equal",
                                      "--check-weight-update-selector", selector))
        skip = ("*.k_scale",) + selector_skips(cfg)
        checked[selector] = [n for n in names if not _skipped(n, skip)]
    assert checked["all"] == names
    assert checked["target"] == names[:1]
    assert checked["draft"] == names[1:]
    with pytest.raises(ConfigError, match="selector draft needs the checkpoint's multi-token-prediction"):
        load_config(None, flags(ckpts["plain"], tmp_path, "--check-weight-update-equal",
                                "--check-weight-update-selector", "draft"))
    with pytest.raises(ConfigError, match="no effect without --check-weight-update-equal"):
        load_config(None, flags(ckpts["mtp"], tmp_path, "--check-weight-update-selector", "target"))


def test_the_ngram_scope_reaches_the_engines(ckpts, tmp_path) -> None:
    cfg = load_config(None, flags(ckpts["plain"], tmp_path, "--sglang-speculative-algorithm", "NGRAM",
                                  "--sglang-speculative-ngram-scope", "engine"))
    cmd = LocalLauncher(cfg, tmp_path)._engine_cmd(1234)
    assert cmd[cmd.index("--speculative-ngram-scope") + 1] == "engine"
