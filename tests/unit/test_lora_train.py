"""LoRA on the FSDP2 trainer: frozen base, adapter-only AdamW, exact resume, PEFT export loaded by peft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from milepost.lora.adapters import attach_lora, freeze_base
from milepost.lora.peft_format import read_peft_adapter
from milepost.lora.settings import LoraSettings
from milepost.models.registry import load_model
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": "q_proj,v_proj,o_proj,gate_proj,down_proj"}
PROBE = [Sample(0, 0, tokens=[1, 40, 41, 42, 43, 44, 45, 46, 47], response_length=6)]


def test_settings_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="--lora-rank must be a positive"):
        LoraSettings(0, 8.0)
    with pytest.raises(ValueError, match="--lora-alpha must be > 0"):
        LoraSettings(4, 0.0)
    with pytest.raises(ValueError, match=r"unknown module\(s\) \['qkv'\]"):
        LoraSettings(4, 8.0, "q_proj,qkv")
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        TrainerSettings(lora_rank=-1)
    with pytest.raises(ValueError, match="unknown module"):
        TrainerSettings(lora_rank=2, lora_target_modules=("lm_head",))
    assert LoraSettings(4, 8.0, "all-linear").target_modules == LoraSettings(4, 8.0).target_modules
    assert LoraSettings(4, 8.0, "v_proj, q_proj").target_modules == ("q_proj", "v_proj")  # canonical order


def test_moe_experts_refused_attention_accepted(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    with pytest.raises(ValueError, match="gate_proj: layer 0 .*mixture-of-experts layers is not supported"):
        attach_lora(load_model(path, torch.float32, "cpu"), LoraSettings(2, 4.0, "q_proj,gate_proj"))
    lm = load_model(path, torch.float32, "cpu")
    assert len(attach_lora(lm, LoraSettings(2, 4.0, "q_proj,k_proj,v_proj,o_proj"))) == 8
    freeze_base(lm)
    trainable = sorted(n for n, p in lm.named_parameters() if p.requires_grad)
    assert len(trainable) == 16 and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def _adapter(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in backend.policy.lm.named_parameters() if ".lora_" in n}


def lora_worker(rank: int, world: int, path: str, run_dir: str) -> dict:
    settings = TrainerSettings(lr=1e-2, global_batch_size=4, max_tokens_per_micro_batch=48, **LORA)
    backend = FSDPBackend.create(path, settings)
    before = backend.compute_logprobs(PROBE)[0]
    base_before = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in backend.policy.lm.named_parameters() if ".lora_" not in n}
    batches = [random_train_batch(4, seed) for seed in range(4)]
    mine = [b.select(split_for_rank([t.numel() for t in b.tokens], rank, world, 4)) for b in batches]
    for b in mine[:2]:
        backend.train_step(b)
    backend.save_checkpoint(Path(run_dir) / "ckpt", {"step": 2})
    saved = list(FileSystemReader(str(Path(run_dir) / "ckpt")).read_metadata().state_dict_metadata)
    continued = [backend.train_step(b)["loss"] for b in mine[2:]]
    adapter_continued = _adapter(backend)
    assert backend.load_checkpoint(Path(run_dir) / "ckpt") == {"step": 2}
    resumed = [backend.train_step(b)["loss"] for b in mine[2:]]
    backend.export_hf(Path(run_dir) / "adapter")
    base_after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                  for n, p in backend.policy.lm.named_parameters() if ".lora_" not in n}
    optimized = {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
    names = {id(p): n for n, p in backend.policy.lm.named_parameters()}
    return {
        "before": before, "after": backend.compute_logprobs(PROBE)[0],
        "continued": continued, "resumed": resumed, "saved": saved,
        "adapter_continued": adapter_continued, "adapter_resumed": _adapter(backend),
        "base_unchanged": all(torch.equal(base_before[n], base_after[n]) for n in base_before),
        "optimized": sorted(names[i] for i in optimized),
        "weights": sorted(n for n, _ in backend.named_hf_weights()),
    }


def test_two_ranks_train_resume_and_export_loads_in_peft(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False)
    results = run_ranks(lora_worker, 2, str(path), str(tmp_path / "run"))
    r = results[0]
    assert r["base_unchanged"]
    assert r["optimized"] and all(".lora_A." in n or ".lora_B." in n for n in r["optimized"])
    assert len(r["optimized"]) == 2 * 5 * 2  # A and B, 5 modules, 2 layers
    # A weight update moves the adapter only, addressed as the engines' adapter "policy".
    assert r["weights"] == sorted(f"policy/{n}" for n in r["optimized"])
    assert r["continued"] == r["resumed"]  # exact resume: same losses, bit for bit
    # The checkpoint holds the adapter and its Adam moments, not the frozen base's projections.
    assert any(".q_proj.lora_A.weight" in k for k in r["saved"])
    assert not any(k.endswith(("q_proj.weight", "down_proj.weight", "norm.weight")) for k in r["saved"]), r["saved"]
    for n, t in r["adapter_continued"].items():
        assert torch.equal(t, r["adapter_resumed"][n]), n
    assert (r["after"] - r["before"]).abs().max() > 1e-3  # the adapter changed the policy
    assert torch.equal(results[1]["after"], r["after"])

    settings, tensors = read_peft_adapter(tmp_path / "run" / "adapter")
    assert settings == LoraSettings(4, 8.0, LORA["lora_target_modules"])
    assert sorted(tensors) == sorted(r["optimized"])
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
    loaded = {n.replace(".default", "").removeprefix("base_model.model."): p
              for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(r["optimized"])  # every exported tensor reached a peft module
    tokens = torch.tensor(PROBE[0].tokens)
    with torch.no_grad():
        logits = model(input_ids=tokens[None]).logits[0].float()
    logp = torch.log_softmax(logits, -1)[2:-1].gather(1, tokens[3:, None])[:, 0]
    torch.testing.assert_close(logp, r["after"], rtol=0, atol=1e-5)
