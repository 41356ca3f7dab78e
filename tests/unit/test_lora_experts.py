"""LoRA on mixture-of-experts experts (tiny Qwen3-MoE, fp32, CPU): the trainer's adapted experts
equal the merged model, one RL step's adapter update reaches the engine (which merges the expert
deltas) with the trainer's log-probs, the PEFT export loads in peft, and the refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.lora.adapters import attach_lora, freeze_base
from milepost.lora.peft_format import read_peft_adapter, write_peft_adapter
from milepost.lora.routes import SEP
from milepost.lora.settings import LoraSettings
from milepost.engine.weight_update import WeightLoader
from milepost.models.registry import load_model
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.testing.lora_adapters import merged_checkpoint, random_adapter
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample
from tests.unit.test_lora_engine import flat, make_engine, run

SETTINGS = LoraSettings(2, 4.0, "all-linear")
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]
PROBE = [Sample(0, 0, tokens=PROMPT, response_length=6)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "base", "qwen3_moe", with_tokenizer=False)


def test_expert_adapters_attach_freeze_and_refuse(moe: Path, tmp_path: Path) -> None:
    lm = load_model(moe, torch.float32, "cpu")
    wrapped = attach_lora(lm, SETTINGS)
    assert "model.layers.1.mlp.experts.gate_up_proj" in wrapped and "model.layers.1.self_attn.q_proj" in wrapped
    freeze_base(lm)
    trainable = {n: tuple(p.shape) for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable["model.layers.0.mlp.experts.gate_up_proj.lora_A.weight"] == (8, 2, 64)  # [E, r, H]
    assert trainable["model.layers.0.mlp.experts.gate_up_proj.lora_B.weight"] == (8, 64, 2)  # [E, 2I, r]
    assert trainable["model.layers.0.mlp.experts.down_proj.lora_B.weight"] == (8, 64, 2)  # [E, H, r]
    assert not any(n.endswith(("w13", "w2")) for n in trainable)
    with pytest.raises(ValueError, match="target both gate_proj and up_proj"):
        attach_lora(load_model(moe, torch.float32, "cpu"), LoraSettings(2, 4.0, "q_proj,gate_proj"))
    with pytest.raises(ValueError, match=r"\[\[lora.adapters\]\] with --lora-target-modules on mixture-of-experts"):
        attach_lora(load_model(moe, torch.float32, "cpu"), LoraSettings(2, 4.0, "all-linear", ("a", "b")))
    dense_too = make_tiny_checkpoint(tmp_path / "mixed", "qwen3_moe", with_tokenizer=False, mlp_only_layers=[1])
    with pytest.raises(ValueError, match="layer 1 of Qwen3MoeForCausalLM is a dense MLP beside"):
        attach_lora(load_model(dense_too, torch.float32, "cpu"), SETTINGS)
    with pytest.raises(ValueError, match="--max-loras-per-batch 1"):
        make_engine(moe, enable_lora=True, max_lora_rank=2)  # 8 slots by default


def expert_worker(rank: int, world: int, path: str, run_dir: str) -> dict:
    settings = TrainerSettings(lr=5e-2, global_batch_size=2, max_tokens_per_micro_batch=64,
                               lora_rank=SETTINGS.rank, lora_alpha=SETTINGS.alpha)
    backend = FSDPBackend.create(path, settings)
    backend.export_hf(Path(run_dir) / "initial")  # what the engines load first (milepost/lora/engines.py)
    backend.train_step(random_train_batch(2, 0))
    backend.export_hf(Path(run_dir) / "trained")
    return {"logprobs": backend.compute_logprobs(PROBE)[0], "sent": dict(backend.named_hf_weights())}


def both_workers(rank: int, world: int, path: str, run_dir: str) -> dict:
    return {"expert": expert_worker(rank, world, path, run_dir), "bf16": bf16_worker(rank, world, path)}


@pytest.fixture(scope="module")
def rank_results(moe: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """Both trainer workers in one rank process (each pays its own start; docs/testing.md).
    (results, the expert worker's export folder)."""
    run_dir = tmp_path_factory.mktemp("experts")
    return run_ranks(both_workers, 1, str(moe), str(run_dir))[0], run_dir


# One group: the fixture's rank process runs once, on the worker that runs these tests.
shared_rank = pytest.mark.xdist_group("lora_experts_rank")


@shared_rank
def test_rl_step_sends_expert_adapters_engine_and_peft_match_trainer(moe: Path, rank_results) -> None:
    r, tmp_path = rank_results[0]["expert"], rank_results[1]
    sent = r["sent"]
    assert "policy/model.layers.0.mlp.experts.gate_up_proj.lora_B.weight" in sent
    assert sent["policy/model.layers.0.mlp.experts.down_proj.lora_B.weight"].abs().max() > 0  # it trained
    engine = make_engine(moe, enable_lora=True, max_lora_rank=2, max_loras_per_batch=1,
                         lora_paths=f"policy={tmp_path / 'initial'}")
    before = flat(run(engine, [("a", PROMPT, "policy")], n=1)["a"])[1]
    assert WeightLoader(engine.runner.model).from_named(sent.items()) == len(sent)
    after = flat(run(engine, [("b", PROMPT, "policy")], n=1)["b"])[1]
    torch.testing.assert_close(torch.tensor(after[2:-1]), r["logprobs"], rtol=0, atol=1e-5)
    assert max(abs(x - y) for x, y in zip(after, before)) > 1e-3  # the update reached the experts
    # Base requests would see the merged experts: refused while the adapter is merged.
    refused = run(engine, [("c", PROMPT, None)], n=1)["c"][-1]
    assert "merged LoRA adapter 'policy'" in str(refused.finish_reason)

    # The exported adapter: peft loads it (experts through target_parameters) with the same log-probs.
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    settings, tensors = read_peft_adapter(tmp_path / "trained")
    assert settings == SETTINGS and sorted(tensors) == sorted(n.split(SEP, 1)[1] for n in sent)
    base = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "trained").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0]
    logp = torch.log_softmax(logits, -1)[2:-1].gather(1, torch.tensor(PROMPT[3:])[:, None])[:, 0]
    torch.testing.assert_close(logp, r["logprobs"], rtol=0, atol=1e-5)
    experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n and ".lora_B." in n}
    assert len(experts) == 4  # 2 layers x (gate_up inside, down outside): every expert tensor reached peft
    with torch.no_grad():
        for p in experts.values():
            p.zero_()
        without = torch.log_softmax(model(input_ids=torch.tensor([PROMPT])).logits[0], -1)
    assert (without[2:-1].gather(1, torch.tensor(PROMPT[3:])[:, None])[:, 0] - logp).abs().max() > 1e-4


def test_engine_expert_adapter_equals_merged_checkpoint(moe: Path, tmp_path: Path) -> None:
    tensors = random_adapter(moe, SETTINGS, 3)
    assert "model.layers.0.mlp.experts.gate_up_proj.lora_A.weight" in tensors
    write_peft_adapter(tensors.items(), SETTINGS, moe, tmp_path / "adapter")
    merged = merged_checkpoint(moe, tmp_path / "merged", SETTINGS, tensors)
    engine = make_engine(moe, enable_lora=True, max_lora_rank=2, max_loras_per_batch=1)
    base_out = run(engine, [("base", PROMPT, None)])["base"]
    engine.runner.lora.load("x", tmp_path / "adapter")
    got = run(engine, [("x", PROMPT, "x")])["x"]
    ref = run(make_engine(merged), [("ref", PROMPT, None)])["ref"]
    assert flat(got)[0] == flat(ref)[0]
    torch.testing.assert_close(torch.tensor(flat(got)[1]), torch.tensor(flat(ref)[1]), rtol=0, atol=1e-5)
    engine.runner.lora.unload("x")  # the base's expert weights come back exactly
    again = run(engine, [("base2", PROMPT, None)])["base2"]
    assert flat(again) == flat(base_out)

    # A base update while the adapter is merged lands in the base copy; the delta is re-added.
    engine.runner.lora.load("x", tmp_path / "adapter")
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    weights = load_file(str(moe / "model.safetensors"))
    weights[name] = weights[name] * 0.5 + 0.1
    assert WeightLoader(engine.runner.model).from_named([(name, weights[name])]) == 1
    shutil.copytree(moe, tmp_path / "base2")
    save_file(weights, str(tmp_path / "base2" / "model.safetensors"), metadata={"format": "pt"})
    merged2 = merged_checkpoint(tmp_path / "base2", tmp_path / "merged2", SETTINGS, tensors)
    got2 = run(engine, [("x2", PROMPT, "x")])["x2"]
    ref2 = run(make_engine(merged2), [("ref2", PROMPT, None)])["ref2"]
    torch.testing.assert_close(torch.tensor(flat(got2)[1]), torch.tensor(flat(ref2)[1]), rtol=0, atol=1e-5)
    assert flat(got2)[1] != flat(got)[1]
    # Colocated engines free the weights between rollouts: the base copies go with them and come back.
    from milepost.engine.memory import MemoryOccupation

    memory = MemoryOccupation(engine)
    memory.release(["weights"])
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.runner.lora.experts.tensors())
    memory.resume(["weights"])
    assert flat(run(engine, [("x3", PROMPT, "x")])["x3"]) == flat(got2)


def test_peft_expert_names_round_trip_and_bad_target_parameters(moe: Path, tmp_path: Path) -> None:
    import json

    tensors = random_adapter(moe, SETTINGS, 4)
    write_peft_adapter(tensors.items(), SETTINGS, moe, tmp_path / "a")
    settings, back = read_peft_adapter(tmp_path / "a")
    assert settings == SETTINGS and all(torch.equal(back[n], t) for n, t in tensors.items())
    down_only = LoraSettings(2, 4.0, "q_proj,down_proj")
    only = {n: t for n, t in random_adapter(moe, down_only, 5).items()}
    write_peft_adapter(only.items(), down_only, moe, tmp_path / "b")  # one wrapper: no base_layer
    assert read_peft_adapter(tmp_path / "b")[0] == down_only
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config | {"target_parameters": ["mlp.w1"]}))
    with pytest.raises(ValueError, match="only mixture-of-experts experts"):
        read_peft_adapter(tmp_path / "a")


def bf16_worker(rank: int, world: int, path: str) -> dict:
    out = {}
    for dtype in ("float32", "bfloat16"):
        settings = TrainerSettings(lr=5e-2, global_batch_size=2, max_tokens_per_micro_batch=64, dtype=dtype,
                                   lora_rank=SETTINGS.rank, lora_alpha=SETTINGS.alpha)
        backend = FSDPBackend.create(path, settings)
        backend.train_step(random_train_batch(2, 0))
        named = list(backend.policy.lm.named_parameters())
        out[dtype] = {"logprobs": backend.compute_logprobs(PROBE)[0],
                      "base": {p.dtype for n, p in named if ".lora_" not in n},
                      "adapter": {p.dtype for n, p in named if ".lora_" in n}}
    return out


@shared_rank
def test_bf16_run_keeps_experts_bf16_and_their_adapters_fp32(rank_results) -> None:
    r = rank_results[0]["bf16"]
    assert r["bfloat16"]["base"] == {torch.bfloat16} and r["bfloat16"]["adapter"] == {torch.float32}
    assert r["float32"]["base"] == {torch.float32}
    diff = (r["bfloat16"]["logprobs"] - r["float32"]["logprobs"]).abs()
    assert diff.max() < 0.1, diff  # bf16 rounding of one trained step (measured: max 0.022, mean 0.012)
