"""TrainConfig: defaults, recipe + override precedence, refusals naming the settings, round trip."""

from __future__ import annotations

import json
import sys
import tomllib
import types
from pathlib import Path

import pytest
from pydantic import ValidationError

import milepost.config_rules as rules
from milepost.cli import main
from milepost.config import TABLE_OF, TABLES, ConfigError, TrainConfig, load_config


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return d


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return p


@pytest.fixture
def base(model_dir: Path, prompts: Path, tmp_path: Path) -> list[str]:
    """The fewest flags of a valid run (device pinned so the tests mean the same on a GPU host)."""
    return [
        "--hf-checkpoint",
        str(model_dir),
        "--prompt-data",
        str(prompts),
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "4",
        "--device",
        "cpu",
        "--run-dir",
        str(tmp_path / "run"),
    ]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_tables_cover_every_field_once() -> None:
    fields = [name for cls in TABLES.values() for name in cls.model_fields]
    assert len(fields) == len(set(fields)) == len(TrainConfig.model_fields)
    assert set(TABLE_OF) == set(TrainConfig.model_fields)
    assert all(info.description for info in TrainConfig.model_fields.values())


def test_defaults_and_derived_values(base: list[str], tmp_path: Path) -> None:
    cfg = load_config(None, base)
    assert (cfg.n_samples_per_prompt, cfg.rollout_temperature, cfg.rollout_top_k) == (8, 1.0, -1)
    assert (cfg.eps_clip, cfg.eps_clip_high, cfg.kl_loss_type, cfg.lr, cfg.adam_beta2) == (
        0.2,
        0.28,
        "k3",
        1e-6,
        0.98,
    )
    assert cfg.update_weight_buffer_size == 512 << 20 and cfg.resume == "auto" and cfg.save_hf_at_end
    assert cfg.apply_chat_template and cfg.rollout_shuffle and not cfg.colocate
    # derived
    assert (cfg.device, cfg.dtype) == ("cpu", "float32")
    assert cfg.rollout_num_engines == 1 and cfg.router is False
    assert cfg.global_batch_size == 32 == cfg.samples_per_rollout == cfg.rollout_max_concurrency
    assert cfg.optimizer_steps_per_rollout == 1
    assert cfg.update_weight_transfer_mode == "broadcast"
    assert cfg.run_dir == tmp_path / "run"
    with pytest.raises(ValidationError):
        cfg.lr = 1.0  # type: ignore[misc]  # frozen: the driver cannot drift from the resolved file


def test_derived_router_transfer_and_run_dir(
    base: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, [*base, "--rollout-num-engines", "2", "--colocate"])
    assert cfg.router is True and cfg.update_weight_transfer_mode == "tensor"
    cfg = load_config(None, [*base, "--rollout-num-engines", "2", "--no-router"])
    assert cfg.router is False
    ext = load_config(
        None, [*base, "--engine-backend", "external", "--engine-urls", "http://a:1,http://b:2/"]
    )
    assert ext.rollout_num_engines == 2 and ext.engine_urls == ["http://a:1", "http://b:2"] and ext.router
    monkeypatch.chdir(tmp_path)
    recipe = _write(tmp_path / "gsm8k-tiny.toml", "")
    no_dir = [a for a in base if a not in ("--run-dir", str(tmp_path / "run"))]
    run_dir = load_config(recipe, no_dir).run_dir
    assert run_dir is not None and run_dir.is_absolute()
    assert run_dir.parent == tmp_path / "runs" and run_dir.name.startswith("gsm8k-tiny-")


def test_recipe_then_overrides(base: list[str], tmp_path: Path) -> None:
    recipe = _write(
        tmp_path / "r.toml",
        """
n_samples_per_prompt = 4            # flat keys are fine too
[optimizer]
lr = 2e-6
clip_grad = 0.5
[rollout]
rollout_stop = ["</answer>", "a,b"]
rollout_temperature = 0.7
[data]
apply_chat_template = false
""",
    )
    cfg = load_config(recipe, base)
    assert (cfg.lr, cfg.clip_grad, cfg.rollout_temperature, cfg.n_samples_per_prompt) == (2e-6, 0.5, 0.7, 4)
    assert cfg.rollout_stop == ["</answer>", "a,b"] and cfg.apply_chat_template is False
    cfg = load_config(
        recipe,
        [
            *base,
            "--lr=3e-6",
            "--apply-chat-template",
            "--rollout_temperature",
            "0.9",
            "--rollout-stop",
            "x,y",
            "--rollout-stop",
            "z",
            "--clip-grad",
            "1",
            "--rollout-stop-token-ids",
            "[1, 2]",
            "--custom-rm-path",
            "pkg.mod:score",
            "--use-kl-loss",
            "false",
            "--rollout-top-k",
            "-1",
            "--no-rollout-shuffle",
        ],
    )
    assert (cfg.lr, cfg.rollout_temperature, cfg.clip_grad) == (3e-6, 0.9, 1.0)
    assert cfg.apply_chat_template is True and cfg.use_kl_loss is False and cfg.rollout_shuffle is False
    assert cfg.rollout_stop == ["x", "y", "z"] and cfg.rollout_stop_token_ids == [1, 2]
    assert cfg.reward_fn == "pkg.mod:score"
    assert load_config(recipe, [*base, "--rollout-stop", "none"]).rollout_stop is None
    assert load_config(recipe, [*base, "--rollout-stop", '["a,b"]']).rollout_stop == ["a,b"]


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[rollout]\nrollout_batchsize = 4\n", ["rollout_batchsize", "did you mean rollout_batch_size"]),
        ("[rolout]\nnum_rollout = 4\n", ["[rolout]", "did you mean [rollout]"]),
        ("[model]\nlr = 1e-5\n", ["lr belongs in table [optimizer], not [model]"]),
        ("lr = 1e-5\n[optimizer]\nlr = 2e-5\n", ["lr is given twice"]),
        ("lr = \n", ["not valid TOML"]),
    ],
)
def test_recipe_errors(tmp_path: Path, base: list[str], text: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path / "bad.toml", text), base)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--rollout-batchsize", "4"],
            "unknown setting --rollout-batchsize; did you mean --rollout-batch-size?",
        ),
        (["--eps_clip_hihg", "0.3"], "did you mean --eps-clip-high?"),
        (["--no-lr"], "unknown setting --no-lr"),
        (["--lr"], "--lr needs a value"),
        (["lr", "1"], "expected a setting as --key value"),
        (["--colocate=maybe"], "--colocate takes true or false"),
    ],
)
def test_override_errors(base: list[str], argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, *argv])
    assert needle in str(err.value)


def test_missing_recipe_and_required_setting(model_dir: Path, prompts: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recipe .*nope.toml does not exist"):
        load_config(tmp_path / "nope.toml", [])
    with pytest.raises(ConfigError) as err:
        load_config(
            None, ["--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts), "--num-rollout", "2"]
        )
    assert "--rollout-batch-size is required" in str(err.value) and "[rollout]" in str(err.value)
    with pytest.raises(ConfigError, match=r"--lr: Input should be greater than 0"):
        load_config(
            None,
            [
                "--hf-checkpoint",
                str(model_dir),
                "--num-rollout",
                "1",
                "--rollout-batch-size",
                "1",
                "--lr",
                "-1",
            ],
        )


@pytest.fixture
def saved_rollouts(tmp_path: Path) -> Path:
    d = tmp_path / "saved"
    d.mkdir()
    return d


REFUSALS = [
    # (extra flags, substrings the message must hold: both settings at fault)
    (
        ["--global-batch-size", "5"],
        ["--global-batch-size 5", "--rollout-batch-size", "--n-samples-per-prompt", "= 32"],
    ),
    (["--actor-num-gpus-per-node", "3"], ["--global-batch-size 32", "--actor-num-gpus-per-node 3"]),
    (["--rollout-only", "--load-rollouts", "{saved}"], ["--load-rollouts", "--rollout-only"]),
    (["--engine-backend", "external"], ["--engine-backend external", "--engine-urls"]),
    (["--engine-urls", "http://a:1"], ["--engine-urls", "--engine-backend embedded"]),
    (
        ["--engine-backend", "external", "--engine-urls", "http://a:1", "--rollout-num-engines", "2"],
        ["--rollout-num-engines 2", "--engine-urls"],
    ),
    (
        ["--colocate", "--update-weight-transfer-mode", "broadcast"],
        ["--colocate", "--update-weight-transfer-mode broadcast"],
    ),
    (
        ["--colocate", "--engine-backend", "external", "--engine-urls", "http://a:1"],
        ["--colocate", "--engine-backend external"],
    ),
    (["--eps-clip-high", "0.1"], ["--eps-clip-high (0.1)", "--eps-clip (0.2)"]),
    (["--kl-loss-coef", "0.01"], ["--kl-loss-coef 0.01", "--use-kl-loss"]),
    (["--n-samples-per-prompt", "1"], ["--advantage-estimator grpo", "--n-samples-per-prompt"]),
    (["--min-lr", "1e-5"], ["--min-lr", "--lr"]),
    (["--rollout-num-gpus-per-engine", "2"], ["--rollout-num-gpus-per-engine", "--engine-backend embedded"]),
    (["--eval-interval", "5"], ["--eval-interval 5 needs --eval-prompt-data"]),
    (["--eval-prompt-data", "{prompts}"], ["--eval-prompt-data", "--eval-interval is 0"]),
    (
        ["--eval-interval", "3", "--eval-prompt-data", "{prompts}", "--update-weights-interval", "2"],
        ["--eval-interval 3", "--update-weights-interval 2"],
    ),
    (
        ["--eval-interval", "1", "--eval-prompt-data", "{prompts}", "--rollout-only"],
        ["--eval-interval", "--rollout-only"],
    ),
    (["--prompt-data", "{missing}"], ["--prompt-data", "does not exist"]),
    (["--prompt-data", "{csv}"], ["--prompt-data", "neither JSONL"]),
    (["--reward-fn", "my_reward"], ["--reward-fn 'my_reward'", "import path"]),
    (["--rollout-top-k", "0"], ["--rollout-top-k must be -1"]),
    (["--resume", "{missing}"], ["--resume", "neither auto, never"]),
    (
        ["--compile-layers", "--activation-checkpointing", "layer"],
        ["--compile-layers", "--activation-checkpointing layer"],
    ),
]


@pytest.mark.parametrize(("extra", "needles"), REFUSALS)
def test_refusals_name_the_settings(
    base: list[str],
    extra: list[str],
    needles: list[str],
    tmp_path: Path,
    prompts: Path,
    saved_rollouts: Path,
) -> None:
    subs = {
        "{saved}": str(saved_rollouts),
        "{prompts}": str(prompts),
        "{missing}": str(tmp_path / "missing.jsonl"),
        "{csv}": str(_write(tmp_path / "prompts.csv", "prompt,label\n")),
    }
    extra = [subs.get(a, a) for a in extra]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, *extra])
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_checkpoint_and_prompt_requirements(model_dir: Path, tmp_path: Path, saved_rollouts: Path) -> None:
    flags = ["--num-rollout", "1", "--rollout-batch-size", "2", "--device", "cpu"]
    with pytest.raises(ConfigError, match="--prompt-data is required"):
        load_config(None, ["--hf-checkpoint", str(model_dir), *flags])
    # training on saved rollouts needs no prompts
    cfg = load_config(
        None, ["--hf-checkpoint", str(model_dir), "--load-rollouts", str(saved_rollouts), *flags]
    )
    assert cfg.load_rollouts == saved_rollouts and cfg.prompt_data is None
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="--hf-checkpoint .* has no config.json"):
        load_config(None, ["--hf-checkpoint", str(empty), "--load-rollouts", str(saved_rollouts), *flags])
    with pytest.raises(ConfigError, match="--hf-checkpoint .* is not a directory"):
        load_config(
            None, ["--hf-checkpoint", str(tmp_path / "nope"), "--load-rollouts", str(saved_rollouts), *flags]
        )


def test_every_refusal_is_reported_at_once(base: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            None, [*base, "--eps-clip-high", "0.1", "--kl-loss-coef", "0.1", "--global-batch-size", "7"]
        )
    assert str(err.value).count("\n") == 2


def test_cuda_refusals(base: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "_cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda was given but CUDA is not available"):
        load_config(None, [*base, "--device", "cuda"])
    assert load_config(None, [*base, "--device", "auto"]).device == "cpu"
    monkeypatch.setattr(rules, "_cuda_available", lambda: True)
    monkeypatch.setattr(rules, "_visible_gpus", lambda: 2)
    cfg = load_config(None, [*base, "--device", "auto"])
    assert (cfg.device, cfg.dtype) == ("cuda", "bfloat16")
    assert (
        load_config(None, [*base, "--device", "cuda", "--rollout-num-engines", "2", "--colocate"]).device
        == "cuda"
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, "--device", "cuda", "--actor-num-gpus-per-node", "2"])
    msg = str(err.value)
    assert "needs 3 GPUs" in msg and "--actor-num-gpus-per-node 2" in msg and "--rollout-num-engines" in msg


@pytest.mark.skipif(
    "sglang" in sys.modules or __import__("importlib").util.find_spec("sglang") is not None,
    reason="sglang is installed",
)
def test_sglang_backend_needs_sglang(base: list[str]) -> None:
    with pytest.raises(ConfigError, match="--engine-backend sglang needs the sglang package"):
        load_config(None, [*base, "--engine-backend", "sglang"])


def test_resolved_config_round_trips(base: list[str], tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            *base,
            "--rollout-stop",
            '["</a>", "quote \\" and \\\\ back", "naïve\\ttab"]',
            "--rollout-stop-token-ids",
            "7,8",
            "--lr",
            "1.5e-7",
            "--colocate",
            "--engine-max-total-tokens",
            "4096",
            "--save-rollouts",
            str(tmp_path / "dump"),
            "--group-reward-fn",
            "a.b:c",
            "--global-batch-size",
            "8",
        ],
    )
    path = cfg.write_resolved()
    assert path == tmp_path / "run" / "config.resolved.toml"
    doc = tomllib.loads(path.read_text())
    assert set(doc) == set(TABLES) and doc["optimizer"]["lr"] == 1.5e-7
    assert "engine_urls" not in doc["engine"]  # unset: written as a comment
    again = load_config(path, [])
    assert again == cfg
    assert again.rollout_stop == ["</a>", 'quote " and \\ back', "naïve\ttab"]
    # an override on top of a resolved file still wins
    assert load_config(path, ["--lr", "1e-7"]).lr == 1e-7


@pytest.fixture
def driver_calls(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    """Stands in for milepost.driver.sync (written elsewhere); records what `milepost train` passes."""
    calls: list[TrainConfig] = []
    fake = types.ModuleType("milepost.driver.sync")
    fake.run = calls.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "milepost.driver.sync", fake)
    return calls


def test_cli_train(base: list[str], tmp_path: Path, driver_calls: list[TrainConfig]) -> None:
    recipe = _write(tmp_path / "r.toml", "[optimizer]\nlr = 2e-6\n")
    assert main(["train", str(recipe), *base, "--lr", "4e-6"]) == 0
    (cfg,) = driver_calls
    assert cfg.lr == 4e-6 and cfg.num_rollout == 3
    assert load_config(tmp_path / "run" / "config.resolved.toml", []) == cfg


def test_cli_train_refuses_and_prints(
    base: list[str], tmp_path: Path, driver_calls: list[TrainConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _write(tmp_path / "r.toml", "")
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(recipe), *base, "--eps-clip-high", "0.1"])
    assert (
        exit_.value.code == 2 and "--eps-clip-high (0.1) is below --eps-clip (0.2)" in capsys.readouterr().err
    )
    assert main(["train", str(recipe), *base, "--print-config", "--rollout-temperature", "0.5"]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["rollout"]["rollout_temperature"] == 0.5
    assert driver_calls == [] and not (tmp_path / "run").exists()
    assert main(["train", str(recipe), "--help"]) == 0
    assert "--n-samples-per-prompt" in capsys.readouterr().out


def test_trainer_speed_settings_reach_the_trainer(base: list[str]) -> None:
    from milepost.driver.trainer_settings import trainer_settings

    default = trainer_settings(load_config(None, base))
    assert (default.activation_checkpointing, default.compile_layers, default.separate_old_logprob_pass) == (
        "none", False, False)
    s = trainer_settings(load_config(None, [*base, "--activation-checkpointing", "layer",
                                            "--separate-old-logprob-pass"]))
    assert s.activation_checkpointing == "layer" and s.separate_old_logprob_pass and not s.compile_layers


def test_the_launcher_checks_a_config_without_importing_torch(base: list[str]) -> None:
    """`milepost train` refuses a bad config about 1.5 s sooner: reading and checking the config and
    importing the launcher need no torch; with `--device auto`, a CPU build of torch (the CI's) is
    recognised from torch/version.py. (Its preflight then loads the tokenizer, which does.)"""
    import subprocess

    flags = list(base)
    if not rules._torch_built_for_gpus():
        flags[flags.index("--device") + 1] = "auto"
    code = ("import sys; from milepost.config import load_config; import milepost.driver.sync, "
            f"milepost.launch.local; c = load_config(None, {flags!r}); print(c.device, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["cpu", "False"], out.stderr[-2000:]
