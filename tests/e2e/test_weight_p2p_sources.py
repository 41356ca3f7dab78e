"""P2P with several senders (report 4.2): two real FSDP2 trainer ranks (gloo) each send to the
engines the transfer plan gives them, into real `milepost serve` processes, and the equality
check (`check_weight_update_equal`: noise first, then bit for bit) passes on every engine.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.testing.server_process import ServerProcess
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync

BUCKET_BYTES = 48_000  # several buckets per update
FLAGS = ("--max-total-tokens", "1024", "--page-size", "4", "--weight-version", "start")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("p2p_sources")
    return {name: make_tiny_checkpoint(root / name, "qwen3", seed=i, with_tokenizer=False)
            for i, name in enumerate("ab")}


@pytest.fixture(scope="module")
def engines(ckpts: dict[str, Path]):
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: ServerProcess(ckpts["a"], *FLAGS), range(2)))
    yield started
    for srv in started:
        srv.close()


def source_worker(rank: int, world: int, ckpt: str, fleets: list[list[str]]) -> list[dict]:
    """One trainer rank: FSDP2-sharded weights; for each fleet of engines in turn, its own P2P
    transport and two updates (one 2-rank run for every fleet: each rank pays its own start and
    FSDP setup; each fleet's equality check starts from noise, so what an earlier fleet left on
    an engine changes nothing)."""
    backend = FSDPBackend.create(ckpt, TrainerSettings(lr=1e-3, global_batch_size=2))
    out = []
    for n, urls in enumerate(fleets):
        transport = P2PTransport(urls, "gloo", timeout_s=60, source_rank=rank, num_sources=world)
        sync = WeightSync(transport, BUCKET_BYTES, dtype=torch.float32, check_equal_once=True,
                          check_weight_update=True)
        try:
            first = sync.update(backend.named_hf_weights(), f"f{n}-s1")
            sent_first = transport.bytes_sent
            with torch.no_grad():  # a trainer step in miniature: one shard changes on every rank
                param = next(backend.policy.lm.parameters())
                (param.to_local() if isinstance(param, DTensor) else param).add_(0.5)
            second = sync.update(backend.named_hf_weights(), f"f{n}-s2")
        finally:
            sync.close()
        out.append({"targets": transport.targets, "path": transport.path, "sent_first": sent_first,
                    "sent": transport.bytes_sent, "verified": [first.verified, second.verified],
                    "bytes": first.bytes})
    return out


FLEETS = [2, 1]  # engines per fleet


@pytest.fixture(scope="module")
def sent(engines, ckpts) -> dict[int, tuple[dict, dict]]:
    """{engines in the fleet: (rank 0's result, rank 1's)}, from one 2-rank run."""
    r0, r1 = run_ranks(source_worker, 2, str(ckpts["b"]), [[e.url for e in engines[:n]] for n in FLEETS],
                       timeout_s=240)
    return {n: (a, b) for n, a, b in zip(FLEETS, r0, r1)}


@pytest.mark.xdist_group("p2p_sources")  # the engines and the ranks' run once, on one worker
@pytest.mark.parametrize("n_engines", FLEETS)
def test_two_trainer_ranks_send_to_their_planned_engines(n_engines, sent) -> None:
    r0, r1 = sent[n_engines]
    # rank 0 ran both checks (noise first, then bit-exact; digests after the second update)
    assert r0["verified"] == [True, True] and r1["verified"] == [False, False]
    assert r0["targets"] == [0] and r0["path"] == "gloo"
    padding = 64 * 100  # flat layout aligns each tensor to 64 bytes
    assert r0["bytes"] <= r0["sent_first"] < r0["bytes"] + padding  # the whole model, once
    if n_engines == 2:  # one to one: each engine fed by its own rank, nothing sent twice
        assert r1["targets"] == [1] and r1["path"] == "gloo"
        assert r1["sent_first"] == r0["sent_first"] and r1["sent"] == r0["sent"]
    else:  # a surplus source sits idle
        assert r1["targets"] == [] and r1["path"] is None and r1["sent"] == 0
