"""The MTP layers through the trainer and every weight-update path, checked by the equality check.

A real FSDP2 trainer (one gloo rank) loads a tiny DeepSeek-V3 checkpoint with an MTP layer: it
keeps the layer (frozen: the policy loss never reaches it) and exports it under the checkpoint's
names, so `--check-weight-update-equal` (noise into every engine tensor, then bit for bit) passes
on a `milepost serve --speculative-algorithm NEXTN` process over the tensor, broadcast and P2P
transports. A trainer that leaves the MTP layer out fails the check unless its names are skipped
(`check_skip`, the `--check-weight-update-equal-skip` glob), and the check pointed at the draft
alone ("!glob", `--check-weight-update-selector draft`) catches exactly that; the exported
directory loads again with its MTP layer.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from milepost.testing.batches import random_train_batch
from milepost.testing.dist import run_ranks
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import BroadcastTransport, TensorTransport
from milepost.weights.verify import WeightMismatchError

MTP = "model.layers.3."  # the tiny model has 3 decoder layers; its MTP layer is the 4th


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_update")
    return {name: make_tiny_mtp_checkpoint(root / name, seed=i, vocab_size=64)
            for i, name in enumerate("ab")}


def trainer(rank: int, world: int, ckpt: str, url: str, out: str) -> dict:
    backend = FSDPBackend.create(ckpt, TrainerSettings(lr=1e-2, global_batch_size=2))
    before = dict(backend.named_hf_weights())
    backend.train_step(random_train_batch(2, seed=0, vocab=64))
    after = dict(backend.named_hf_weights())
    mtp = [n for n in after if n.startswith(MTP)]
    result: dict = {
        "mtp_names": len(mtp),
        "target_changed": any(not torch.equal(before[n], after[n]) for n in after if n not in mtp),
        "mtp_changed": [n for n in mtp if not torch.equal(before[n], after[n])],
    }
    transports = {"tensor": lambda: TensorTransport([url]),
                  "broadcast": lambda: BroadcastTransport([url], "gloo", timeout_s=60),
                  "p2p": lambda: P2PTransport([url], "gloo", timeout_s=60)}
    for kind, make in transports.items():
        sync = WeightSync(make(), 48_000, dtype=torch.float32, check_equal_once=True)
        try:
            result[kind] = sync.update(backend.named_hf_weights(), f"step1-{kind}").verified
        finally:
            sync.close()

    def no_mtp():
        return ((n, t) for n, t in backend.named_hf_weights() if not n.startswith(MTP))

    sync = WeightSync(TensorTransport([url]), 48_000, dtype=torch.float32, check_equal_once=True)
    try:
        sync.update(no_mtp(), "no-mtp")
        result["unskipped"] = "passed"
    except WeightMismatchError as e:
        result["unskipped"] = str(e)
    sync = WeightSync(TensorTransport([url]), 48_000, dtype=torch.float32, check_equal_once=True,
                      check_skip=(MTP + "*",))
    result["skipped"] = sync.update(no_mtp(), "skip-mtp").verified
    # --check-weight-update-selector draft ("!glob"): only the MTP layer is compared
    draft_only = (f"!{MTP}*",)
    sync = WeightSync(TensorTransport([url]), 48_000, dtype=torch.float32, check_equal_once=True,
                      check_skip=draft_only)
    result["draft_checked"] = sync.update(backend.named_hf_weights(), "draft").verified
    sync = WeightSync(TensorTransport([url]), 48_000, dtype=torch.float32, check_equal_once=True,
                      check_skip=draft_only)
    try:
        sync.update(no_mtp(), "draft-missing")
        result["draft_missing"] = "passed"
    except WeightMismatchError as e:
        result["draft_missing"] = str(e)
    # leave the engine with the trained weights, MTP included
    WeightSync(TensorTransport([url]), 48_000, dtype=torch.float32).update(backend.named_hf_weights(), "final")
    backend.export_hf(out)
    return result


def test_mtp_layers_are_kept_exported_and_checked_on_every_transport(ckpts, tmp_path) -> None:
    from milepost.models.registry import load_model

    srv = ServerProcess(ckpts["a"], "--max-total-tokens", "1024", "--page-size", "4",
                        "--speculative-algorithm", "NEXTN", "--weight-version", "start")
    try:
        (r,) = run_ranks(trainer, 1, str(ckpts["b"]), srv.url, str(tmp_path / "export"), timeout_s=240)
        assert r["mtp_names"] > 20 and r["target_changed"]
        assert r["mtp_changed"] == [], "the policy loss never reaches the MTP layer: it stays as loaded"
        assert r["tensor"] and r["broadcast"] and r["p2p"]
        assert "never written by the update" in r["unskipped"] and MTP in r["unskipped"]
        assert r["skipped"] and r["draft_checked"]
        assert "never written by the update" in r["draft_missing"] and MTP in r["draft_missing"]
        body = {"input_ids": [5, 6, 7, 8] * 3, "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                                   "ignore_eos": True}}
        reply = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
        assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 12
    finally:
        srv.close()
    exported = load_model(tmp_path / "export", torch.float32, "cpu")
    assert exported.num_mtp_layers == 1
    trained = load_model(ckpts["b"], torch.float32, "cpu")
    assert torch.equal(exported.weight_view(MTP + "eh_proj.weight"), trained.weight_view(MTP + "eh_proj.weight"))
