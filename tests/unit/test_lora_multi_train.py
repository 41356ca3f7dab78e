"""Multi-LoRA on the FSDP2 trainer: two named adapters on one frozen base, each token through its
sample's adapter, per-adapter lr, an adapter without samples does not move and is not sent."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.lora.peft_format import read_peft_adapter
from milepost.lora.settings import LoraSettings
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": ("q_proj", "v_proj", "down_proj"),
        "lora_adapters": (("add", 1e-2), ("sub", 5e-3))}
TOKENS = [1, 40, 41, 42, 43, 44, 45, 46, 47]


def probe(adapter: str) -> Sample:
    return Sample(0, 0, tokens=TOKENS, response_length=6, metadata={"lora_adapter": adapter})


def _params(backend: FSDPBackend, adapter: str) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in backend.policy.lm.named_parameters() if f".{adapter}." in n}


def _tagged(seed: int, adapters: list[str], rank: int, world: int):
    b = dataclasses.replace(random_train_batch(4, seed), adapters=adapters)
    return b.select(split_for_rank([t.numel() for t in b.tokens], rank, world, 4))


def multi_worker(rank: int, world: int, path: str, run_dir: str) -> dict:
    settings = TrainerSettings(lr=1e-2, global_batch_size=4, max_tokens_per_micro_batch=48, **LORA)
    backend = FSDPBackend.create(path, settings)
    lrs = {g["adapter"]: g["lr"] for g in backend.optimizer.param_groups}
    sent0 = sorted({n.split("/")[0] for n, _ in backend.named_hf_weights()})
    before = backend.compute_logprobs([probe("add"), probe("sub")])
    sub_before = _params(backend, "sub")
    backend.train_step(_tagged(0, ["add"] * 4, rank, world))  # only 'add' has samples
    sub_after = _params(backend, "sub")
    sent1 = sorted({n.split("/")[0] for n, _ in backend.named_hf_weights()})
    after = backend.compute_logprobs([probe("add"), probe("sub")])
    alone = [backend.compute_logprobs([probe(a)])[0] for a in ("add", "sub")]
    backend.train_step(_tagged(1, ["sub", "add", "sub", "add"], rank, world))
    sent2 = sorted({n.split("/")[0] for n, _ in backend.named_hf_weights()})
    backend.export_hf(Path(run_dir) / "hf")
    with pytest.raises(ValueError, match="every sample needs its adapter"):
        backend.compute_logprobs([Sample(0, 0, tokens=TOKENS, response_length=6)])
    return {"lrs": lrs, "sent": [sent0, sent1, sent2], "before": before, "after": after, "alone": alone,
            "sub_still": all(torch.equal(sub_before[n], sub_after[n]) for n in sub_before),
            "sub_state": [len(backend.optimizer.state[p]) for g in backend.optimizer.param_groups
                          if g["adapter"] == "sub" for p in g["params"]],
            "add": _params(backend, "add")}


def test_two_adapters_route_step_and_send_apart(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False)
    results = run_ranks(multi_worker, 2, str(path), str(tmp_path / "run"))
    r = results[0]
    assert r["lrs"] == {"add": 1e-2, "sub": 5e-3}  # each adapter its own lr (constant schedule)
    assert r["sent"] == [["add", "sub"], ["add"], ["add", "sub"]]  # first update all, then the stepped
    assert r["sub_still"]  # no 'sub' sample: its weights did not move
    assert all(n > 0 for n in r["sub_state"])  # ... and it stepped once the mixed batch came
    # Fresh adapters (B = 0) are the base; after the step only 'add' samples see a change.
    torch.testing.assert_close(r["before"][0], r["before"][1], rtol=0, atol=0)
    assert (r["after"][0] - r["before"][0]).abs().max() > 1e-3
    torch.testing.assert_close(r["after"][1], r["before"][1], rtol=0, atol=0)
    # Mixed in one micro-batch, each sample scores as it does alone: tokens go to their adapter.
    for mixed, alone in zip(r["after"], r["alone"]):
        torch.testing.assert_close(mixed, alone, rtol=0, atol=1e-6)
    assert torch.equal(results[1]["after"][0], r["after"][0])
    for adapter in ("add", "sub"):  # one PEFT directory per adapter, plain PEFT names
        settings, tensors = read_peft_adapter(tmp_path / "run" / "hf" / adapter)
        assert settings == LoraSettings(4, 8.0, LORA["lora_target_modules"])
        assert len(tensors) == 2 * 3 * 2 and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in tensors)
    _, add = read_peft_adapter(tmp_path / "run" / "hf" / "add")
    for n, t in r["add"].items():
        assert torch.equal(add[n.replace(".add.", ".")], t), n
