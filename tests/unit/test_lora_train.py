"""LoRA on the FSDP2 trainer: frozen base, adapter-only AdamW, exact resume, PEFT export loaded by peft."""

from __future__ import annotations

import contextlib
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


def test_moe_attention_only_adapter(tmp_path: Path) -> None:
    """Experts get adapters only when MLP modules are targeted (tests/unit/test_lora_experts.py)."""
    path = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
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


def _local_bytes(params) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in params)


def bf16_base_worker(rank: int, world: int, path: str, run_dir: str) -> dict:
    from unittest import mock

    settings = TrainerSettings(lr=1e-2, global_batch_size=4, max_tokens_per_micro_batch=48, dtype="bfloat16",
                               use_kl_loss=True, kl_loss_coef=0.1, **LORA)  # a reference model too
    batches = [random_train_batch(4, seed) for seed in range(2)]
    batches = [b.select(split_for_rank([t.numel() for t in b.tokens], rank, world, 4)) for b in batches]
    out = {}
    for kind in ("fp32 base", "bf16 base"):  # the first as before: the frozen base kept as loaded
        keep = mock.patch("milepost.train.fsdp_setup.store_frozen_in", lambda *a: 0)
        with keep if kind == "fp32 base" else contextlib.nullcontext():
            backend = FSDPBackend.create(path, settings)
        named = list(backend.policy.lm.named_parameters())
        base = [p for n, p in named if ".lora_" not in n]
        adapter = [p for n, p in named if ".lora_" in n]
        losses = [backend.train_step(b)["loss"] for b in batches]
        backend.save_checkpoint(Path(run_dir) / kind, {"step": 2})
        after = backend.compute_logprobs(PROBE)[0]
        backend.load_checkpoint(Path(run_dir) / kind)
        out[kind] = {
            "base_bytes": _local_bytes(base), "adapter_bytes": _local_bytes(adapter),
            "reference_bytes": _local_bytes(backend.reference.parameters()),
            "reference_dtypes": {p.dtype for p in backend.reference.parameters()},
            "base_dtypes": {p.dtype for p in base}, "adapter_dtypes": {p.dtype for p in adapter},
            "adam_dtypes": {t.dtype for s in backend.optimizer.state.values() for t in s.values() if t.ndim},
            "losses": losses, "after": after, "resumed": backend.compute_logprobs(PROBE)[0],
            "sent": {n: t.dtype for n, t in backend.named_hf_weights()},
        }
        backend.export_hf(Path(run_dir) / f"{kind} adapter")
    return out


def test_bf16_run_stores_the_frozen_base_in_bf16_with_fp32_adapters(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False)
    # One rank keeps it cheap; two ranks (run by hand, 2026-12-04) halve each rank's bytes again.
    r = run_ranks(bf16_base_worker, 1, str(path), str(tmp_path / "run"))[0]
    old, new = r["fp32 base"], r["bf16 base"]
    assert old["base_dtypes"] == {torch.float32} and new["base_dtypes"] == {torch.bfloat16}
    assert new["adapter_dtypes"] == new["adam_dtypes"] == {torch.float32}  # fp32 masters and moments
    assert new["base_bytes"] * 2 == old["base_bytes"] and new["adapter_bytes"] == old["adapter_bytes"]
    assert new["reference_dtypes"] == {torch.bfloat16} and new["reference_bytes"] * 2 == old["reference_bytes"]
    # FSDP2 gathered the fp32 base as bf16 anyway: the same compute (KL to the reference included), bit for bit.
    assert new["losses"] == old["losses"]
    assert torch.equal(new["after"], old["after"]) and torch.equal(new["resumed"], new["after"])
    assert new["sent"] == old["sent"] and set(new["sent"].values()) == {torch.bfloat16}  # adapter only
    settings, tensors = read_peft_adapter(tmp_path / "run" / "bf16 base adapter")
    _, old_tensors = read_peft_adapter(tmp_path / "run" / "fp32 base adapter")
    assert all(t.dtype == torch.float32 and torch.equal(t, old_tensors[n]) for n, t in tensors.items())
