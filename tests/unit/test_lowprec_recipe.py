"""Recipe settings of the precision contract: first / last layers kept in bf16 (resolved against
the checkpoint at start, the same tensors at all four stages), `--fp8-scaling delayed` (reaches
the trainer, TIS on by default) and `--nvfp4-stochastic-rounding` (trainer only), each refused
where it cannot apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from milepost.config import ConfigError, load_config
from milepost.driver.trainer_settings import trainer_settings
from milepost.engine.weight_update import WeightLoader
from milepost.launch.local import LocalLauncher
from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import main as convert_main
from milepost.lowprec.engine_setup import engine_contract
from milepost.lowprec.engine_store import QuantizedLinear, store_quantized
from milepost.lowprec.linear import LowPrecLinear, apply_train_precision
from milepost.lowprec.rules import run_contract
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.run_args import stub_run_args

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("recipe") / "m", "qwen3", seed=4,
                                with_tokenizer=False, num_hidden_layers=4)


def _args(tmp_path: Path, ckpt: Path, *flags: str) -> list[str]:
    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                         "--n-samples-per-prompt", "2", "--device", "cpu", *flags)
    args[args.index("--hf-checkpoint") + 1] = str(ckpt)
    return args


def test_first_and_last_layers_stay_bf16_at_all_four_stages(tmp_path: Path, ckpt: Path) -> None:
    cfg = load_config(None, _args(tmp_path, ckpt, "--precision", "fp8",
                                  "--precision-bf16-first-layers", "1",
                                  "--precision-bf16-last-layers", "2"))
    assert run_contract(cfg).overrides == (("layers.0-0", "bf16"), ("layers.2-3", "bf16"))
    quantized = {f"model.layers.1.{p}.weight" for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    # Trainer forward: the settings the driver builds.
    s = trainer_settings(cfg)
    trainer = load_model(ckpt, torch.float32, "cpu")
    contract = Contract(s.precision, s.precision, s.precision_overrides)
    assert set(apply_train_precision(trainer, contract)) == quantized
    # Engines: the flags the launcher passes, read as the server reads them.
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    override = cmd[cmd.index("--precision-override") + 1]
    assert override == "layers.0-0=bf16,layers.2-3=bf16"
    engine = load_model(ckpt, torch.float32, "cpu")
    engine.fuse_projections()
    store = store_quantized(engine, engine_contract("fp8_block", override, False))
    held = {n for n in engine.hf_weight_names() if n.endswith("proj.weight")
            and store.owner(engine.weight_view(n)) is not None}
    assert held == quantized
    assert isinstance(engine.model.layers[1].mlp.gate_up_proj, QuantizedLinear)
    assert not isinstance(engine.model.layers[3].mlp.gate_up_proj, QuantizedLinear)
    # Live export: an update re-quantized on arrival = the trainer's values; bf16 layers exact.
    sent = {n: t * 1.5 for n, t in load_file(ckpt / "model.safetensors").items()}
    WeightLoader(engine).from_named(sent.items(), strict_dtype=True)
    for n, t in sent.items():
        if n.endswith("proj.weight"):
            lin = trainer.get_submodule(n.removesuffix(".weight"))
            with torch.no_grad():
                lin.weight.copy_(t)
            want = lin.quantized_weight() if isinstance(lin, LowPrecLinear) else t
            view = engine.weight_view(n)
            got = store.dequantized(view)[0] if store.owner(view) is not None else view
            assert torch.equal(got, want), n
    # Checkpoint conversion: the same tensors in FP8, the same ranges from the same config.json.
    dst = tmp_path / "fp8"
    convert_main([str(ckpt), str(dst), "--precision-bf16-first-layers", "1",
                  "--precision-bf16-last-layers", "2"])
    converted = load_file(dst / "model.safetensors")
    assert {n for n, t in converted.items() if t.dtype == torch.float8_e4m3fn} == quantized
    config = json.loads((dst / "config.json").read_text())
    # Module names (as transformers and SGLang match them): the overridden layers' projections
    # among them, and every other unquantized 2-d weight's module (lm_head, embeddings).
    skipped = set(config["quantization_config"]["modules_to_not_convert"])
    assert {n for n in skipped if ".layers." in n} == {
        n.removesuffix(".weight") for n, t in converted.items()
        if n.endswith(".weight") and t.dim() == 2 and ".layers." in n and t.dtype != torch.float8_e4m3fn}
    assert {n.removesuffix(".weight") for n in quantized}.isdisjoint(skipped)


def test_delayed_scaling_reaches_the_trainer_and_static_engines(tmp_path: Path, ckpt: Path) -> None:
    cfg = load_config(None, _args(tmp_path, ckpt, "--precision", "fp8", "--fp8-scaling", "delayed",
                                  "--fp8-amax-history-len", "16",
                                  "--fp8-amax-compute-algo", "most_recent", "--fp8-margin", "1"))
    s = trainer_settings(cfg)
    assert (s.fp8_scaling, s.fp8_amax_history_len, s.fp8_amax_compute_algo, s.fp8_margin) == (
        "delayed", 16, "most_recent", 1)
    assert cfg.ratio_correction == "none"  # the engines take the trainer's input scales: one format
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    assert cmd[cmd.index("--quantization") + 1] == "fp8_block"
    assert cmd[cmd.index("--fp8-activation-scheme") + 1] == "static"
    current = load_config(None, _args(tmp_path, ckpt, "--precision", "fp8"))
    assert current.ratio_correction == "none"
    assert "--fp8-activation-scheme" not in LocalLauncher(current, current.run_dir)._engine_cmd(1)
    sr = load_config(None, _args(tmp_path, ckpt, "--precision", "nvfp4", "--nvfp4-stochastic-rounding"))
    assert trainer_settings(sr).nvfp4_stochastic_rounding
    assert "--nvfp4-stochastic-rounding" not in LocalLauncher(sr, sr.run_dir)._engine_cmd(12345)


@pytest.mark.parametrize(("flags", "message"), [
    (["--fp8-scaling", "delayed"], r"--fp8-scaling delayed needs an FP8 trainer.*--precision bf16"),
    (["--precision", "mxfp8", "--fp8-scaling", "delayed"], "the trainer runs mxfp8"),
    (["--precision", "bf16-train-fp8-serve", "--fp8-scaling", "delayed"], "the trainer runs bf16"),
    (["--precision", "fp8", "--fp8-margin", "2"], "--fp8-margin set the delayed-scaling recipe"),
    (["--precision", "fp8", "--fp8-scaling", "delayed", "--train-backend", "megatron"],
     "use --train-backend fsdp"),
    (["--precision", "fp8", "--precision-bf16-last-layers", "5"],
     "--precision-bf16-last-layers 5: the model has 4 decoder layers"),
    (["--precision-bf16-first-layers", "1"], "this run quantizes nothing"),
    (["--precision", "fp8", "--nvfp4-stochastic-rounding"], "the trainer runs fp8_block"),
    (["--precision", "nvfp4", "--nvfp4-stochastic-rounding", "--nvfp4-dequantized-backward"],
     "quantizes no gradient to round"),
])
def test_refused_at_start_naming_the_settings(tmp_path: Path, ckpt: Path, flags: list[str],
                                              message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, _args(tmp_path, ckpt, *flags))
