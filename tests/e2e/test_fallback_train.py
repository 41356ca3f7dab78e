"""The FSDP2 trainer over a transformers-fallback model (Phi-3 with a sliding window) on gloo ranks.

Log-probs equal transformers' before training; a step moves them; the exported directory loads
in transformers and scores as the trainer does; both ranks hold the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from milepost.models.hf_fallback import HFCausalLM
from milepost.testing.batches import random_train_batch
from milepost.testing.dist import run_ranks
from milepost.testing.hf_archs import make_tiny_hf_checkpoint
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

# Layer checkpointing: the fallback's attention also runs in the recompute during backward.
SETTINGS = dict(lr=1e-3, lr_warmup_iters=1, global_batch_size=4, max_tokens_per_micro_batch=40,
                activation_checkpointing="layer")
PROBE = [Sample(0, 0, tokens=list(range(3, 3 + k)), response_length=k - 2) for k in (6, 11)]


def worker(rank: int, world: int, path: str, export: str) -> dict:
    backend = FSDPBackend.create(path, TrainerSettings(**SETTINGS))
    assert isinstance(backend.policy.lm, HFCausalLM)
    before = backend.compute_logprobs(PROBE)
    full = random_train_batch(8, 1)
    mine = full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))
    metrics = backend.train_step(mine)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in backend.policy.lm.named_parameters()}
    after = backend.compute_logprobs(PROBE)
    if export:
        backend.export_hf(export)
    return {"before": before, "after": after, "metrics": metrics, "params": params}


def hf_logprobs(path: Path, samples: list[Sample]) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(s.tokens)
            logp = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
            rows = torch.arange(len(ids) - s.response_length - 1, len(ids) - 1)
            out.append(logp[rows, ids[rows + 1]])
    return out


def test_fsdp_trains_a_fallback_model(tmp_path: Path) -> None:
    path = make_tiny_hf_checkpoint(tmp_path / "phi3", "phi3", sliding_window=5)  # windows in backward too
    ranks = run_ranks(worker, 2, str(path), str(tmp_path / "export"), timeout_s=600)
    for got, want in zip(ranks[0]["before"], hf_logprobs(path, PROBE)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert ranks[0]["metrics"]["tokens"] > 0
    assert any(not torch.allclose(a, b) for a, b in zip(ranks[0]["before"], ranks[0]["after"])), \
        "the step moved nothing"
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name
    for got, want in zip(ranks[1]["after"], hf_logprobs(tmp_path / "export", PROBE)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
