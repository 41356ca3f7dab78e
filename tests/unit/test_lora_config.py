"""LoRA run settings: defaults reach the trainer and the engine command; bad combinations refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.driver.trainer_settings import trainer_settings
from milepost.launch.local import LocalLauncher
from milepost.testing.run_args import stub_run_args


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    return stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--device", "cpu")


def test_lora_settings_reach_trainer_and_engines(base: list[str]) -> None:
    cfg = load_config(None, [*base, "--lora-rank", "8", "--lora-alpha", "16",
                             "--lora-target-modules", "q_proj,v_proj"])
    lora = trainer_settings(cfg).lora
    assert lora is not None and (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    assert cmd.count("--enable-lora") == 1
    i = cmd.index("--enable-lora")
    assert cmd[i + 1 : i + 5] == ["--max-lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"]
    assert trainer_settings(load_config(None, base)).lora is None  # rank 0: full training
    # An fp8 base serves bf16/fp32 adapters (docs/lora.md): both flags reach the engines.
    fp8 = load_config(None, [*base, "--lora-rank", "4", "--engine-quantization", "fp8"])
    cmd = LocalLauncher(fp8, fp8.run_dir)._engine_cmd(12345)
    assert "--enable-lora" in cmd and cmd[cmd.index("--quantization") + 1] == "fp8"
    # Composes (tests/e2e/test_lora_composes.py runs them): fully async, GSPO, TIS, a PPO critic.
    load_config(None, [*base, "--lora-rank", "4", "--fully-async", "--advantage-estimator", "gspo",
                       "--ratio-correction", "tis"])
    load_config(None, [*base, "--lora-rank", "4", "--advantage-estimator", "ppo", "--critic-lr", "1e-3"])
    load_config(None, [*base, "--lora-rank", "4", "--use-session-server", "--session-model-family", "qwen3"])
    assert "--enable-lora" not in LocalLauncher(load_config(None, base), Path("unused"))._engine_cmd(12345)


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora-target-modules", "q_proj,lm_head"], r"unknown module\(s\) \['lm_head'\]"),
    (["--update-weight-transfer-mode", "p2p"], "p2p does not carry LoRA adapters"),
    (["--update-weight-transfer-mode", "disk-delta"], "disk-delta does not carry LoRA adapters"),
    (["--eval-mode", "dedicated"], "--lora-rank with --eval-mode dedicated: its engines load full-model"),
])
def test_lora_refusals_name_the_setting(base: list[str], flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, "--lora-rank", "4", *flags])
    with pytest.raises(ConfigError, match="--lora-rank"):
        load_config(None, [*base, "--lora-rank", "-1"])


def test_models_lora_cannot_adapt_refused_at_start(tmp_path: Path) -> None:
    """Before any process starts: half of the experts' fused gate_up as targets, and a
    transformers-fallback architecture (MoE experts themselves are adapted: test_lora_experts.py)."""
    import json

    from milepost.testing.checkpoints import make_tiny_checkpoint

    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4", "--device", "cpu")
    args[1] = str(moe)
    with pytest.raises(ConfigError, match="target both gate_proj and up_proj, or neither"):
        load_config(None, [*args, "--lora-rank", "4", "--lora-target-modules", "q_proj,gate_proj"])
    load_config(None, [*args, "--lora-rank", "4"])  # all-linear: the experts too
    load_config(None, [*args, "--lora-rank", "4", "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj"])
    entries = [{"name": n, "prompt_data": args[3]} for n in ("a", "b")]
    with pytest.raises(ConfigError, match="multi-LoRA adapts attention and dense MLPs only"):
        load_config(None, [*args[:2], *args[4:], *_adapters(tmp_path, *entries), "--lora-rank", "4"])
    args[1] = str(tmp_path / "mixtral")
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(
        {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ConfigError, match="--lora-rank: .*mixtral has no native model definition"):
        load_config(None, [*args, "--lora-rank", "4", "--lora-target-modules", "q_proj"])


def _adapters(tmp_path: Path, *entries: dict) -> list[str]:
    import json

    return ["--lora-adapters", json.dumps(list(entries))]


def test_multi_lora_adapters_reach_trainer_and_engines(tmp_path: Path) -> None:
    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4", "--device", "cpu",
                         "--lr", "1e-3", "--lora-rank", "4")
    prompts = args[3]
    args = args[:2] + args[4:]  # no --prompt-data: each adapter names its own
    cfg = load_config(None, [*args, *_adapters(tmp_path, {"name": "add", "prompt_data": prompts, "lr": 5e-3},
                                               {"name": "sub", "prompt_data": prompts,
                                                "reward_fn": "milepost.lora.demo_tasks:estimate_reward"})])
    s = trainer_settings(cfg)
    assert s.lora_adapters == (("add", 5e-3), ("sub", 1e-3))  # lr defaults to the run's
    assert s.lora.adapters == ("add", "sub")
    assert "--enable-lora" in LocalLauncher(cfg, Path("unused"))._engine_cmd(12345)
    # Per-adapter evaluation: eval_prompt_data in an entry stands for --eval-prompt-data.
    ev = {"name": "add", "prompt_data": prompts, "eval_prompt_data": prompts}
    cfg = load_config(None, [*args, "--eval-interval", "2", *_adapters(tmp_path, ev, {"name": "sub", "prompt_data": prompts})])
    assert cfg.adapters[0]["eval_prompt_data"] == prompts
    with pytest.raises(ConfigError, match=r"entry 1 \(add\): eval_prompt_data is set but --eval-interval is 0"):
        load_config(None, [*args, *_adapters(tmp_path, ev)])
    with pytest.raises(ConfigError, match=r"entry 1 \(add\): eval_prompt_data 'nope.jsonl' is not a file"):
        load_config(None, [*args, "--eval-interval", "2", *_adapters(tmp_path, ev | {"eval_prompt_data": "nope.jsonl"})])
    with pytest.raises(ConfigError, match="--eval-interval 2 needs --eval-prompt-data"):
        load_config(None, [*args, "--eval-interval", "2", *_adapters(tmp_path, {"name": "add", "prompt_data": prompts})])


@pytest.mark.parametrize(("entries", "message"), [
    ([{"name": "a b", "prompt_data": "P"}], r"entry 1: name 'a b' must match"),
    ([{"name": "a", "prompt_data": "P"}, {"name": "a", "prompt_data": "P"}], "names \\['a', 'a'\\] repeat"),
    ([{"name": "a", "prompt_data": "nope.jsonl"}], r"entry 1 \(a\): prompt_data 'nope.jsonl' is not a file"),
    ([{"name": "a", "prompt_data": "P", "lr": 0}], r"entry 1 \(a\): lr 0 must be a number > 0"),
    ([{"name": "a", "prompt_data": "P", "reward_fn": "mystery"}], "reward_fn 'mystery' is neither a builtin"),
    ([{"name": "a", "prompt_data": "P", "dataset": "x"}], r"unknown key\(s\) \['dataset'\]"),
])
def test_multi_lora_bad_entries_refused_naming_them(tmp_path: Path, entries: list[dict], message: str) -> None:
    import json

    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4", "--device", "cpu",
                         "--lora-rank", "4")
    prompts = args[3]
    entries = [{k: (prompts if v == "P" else v) for k, v in e.items()} for e in entries]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*args[:2], *args[4:], "--lora-adapters", json.dumps(entries)])
    ok = json.dumps([{"name": "a", "prompt_data": prompts}])
    with pytest.raises(ConfigError, match="with --prompt-data"):
        load_config(None, [*args, "--lora-adapters", ok])
    with pytest.raises(ConfigError, match="with --check-weight-update-equal"):
        load_config(None, [*args[:2], *args[4:], "--lora-adapters", ok, "--check-weight-update-equal"])
    load_config(None, [*args[:2], *args[4:], "--lora-adapters", ok, "--fully-async"])  # composes
    with pytest.raises(ConfigError, match=r"\[\[lora.adapters\]\] with --use-session-server \(the session server"):
        load_config(None, [*args[:2], *args[4:], "--lora-adapters", ok, "--use-session-server",
                           "--session-model-family", "qwen3"])
    with pytest.raises(ConfigError, match="needs --lora-rank > 0"):
        load_config(None, [*args[:2], *args[4:-2], "--lora-adapters", ok])


def test_resume_with_other_lora_settings_refused_naming_both(tmp_path: Path) -> None:
    """A checkpoint records its LoRA layout: resuming it with another rank, targets, adapter names,
    or with LoRA switched on or off, is refused before anything starts (the adapter would not load,
    or the base would be trained as if it were the adapter)."""
    import json

    from milepost.driver.preflight import RunError, check_resume, lora_fingerprint, model_fingerprint
    from milepost.train.checkpoint import META_FILE, checkpoint_path

    args = stub_run_args(tmp_path, "--num-rollout", "4", "--rollout-batch-size", "4", "--device", "cpu")
    trained = load_config(None, [*args, "--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj"])
    path = checkpoint_path(trained.run_dir, 1)
    path.mkdir(parents=True)

    def write(lora: object) -> None:
        extra = {"step": 1, "model": model_fingerprint(trained.hf_checkpoint)}
        (path / META_FILE).write_text(json.dumps({"extra": extra if lora == "absent" else extra | {"lora": lora}}))

    write(lora_fingerprint(trained))
    check_resume(trained, path)  # the same settings resume
    check_resume(load_config(None, [*args, "--lora-rank", "4", "--lora-target-modules", "v_proj,q_proj"]), path)
    was = "trained with --lora-rank 4 --lora-alpha 16.0 --lora-target-modules q_proj,v_proj, but this run has"
    for flags, now in [(["--lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"], "--lora-rank 8 "),
                       (["--lora-rank", "4"], "--lora-rank 4 --lora-alpha 16.0 --lora-target-modules q_proj,k_proj,"),
                       ([], "full-parameter training")]:
        with pytest.raises(RunError, match=f"latest checkpoint of --run-dir .*{was} {now}"):
            check_resume(load_config(None, [*args, *flags]), path)
    write(None)  # a full-parameter checkpoint
    check_resume(load_config(None, args), path)
    with pytest.raises(RunError, match="trained with full-parameter training .* this run has --lora-rank 4"):
        check_resume(trained, path)
    write("absent")  # written before checkpoints recorded LoRA: nothing to compare
    check_resume(trained, path)
    prompts = args[3]
    multi = [*args[:2], *args[4:], "--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj"]
    one = load_config(None, [*multi, "--lora-adapters", json.dumps([{"name": "a", "prompt_data": prompts}])])
    write(lora_fingerprint(one))
    two = json.dumps([{"name": "a", "prompt_data": prompts}, {"name": "b", "prompt_data": prompts}])
    with pytest.raises(RunError, match=r"\[\[lora.adapters\]\] \['a'\], but .*\[\[lora.adapters\]\] \['a', 'b'\]"):
        check_resume(load_config(None, [*multi, "--lora-adapters", two]), path)
