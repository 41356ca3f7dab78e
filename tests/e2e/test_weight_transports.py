"""All four weight transports against real `milepost serve` processes (CPU, gloo), each proven by
`--check-weight-update-equal`: engines are filled with noise, the first update must overwrite
every tensor bit for bit (a transport that skips one fails), and a second update is checked too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.bucket import Named
from milepost.weights.disk_transport import DiskDeltaTransport
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import BroadcastTransport, TensorTransport
from milepost.weights.verify import WeightMismatchError, verify

BUCKET_BYTES = 48_000  # several buckets per update; the embedding travels alone
FLAGS = ("--max-total-tokens", "1024", "--page-size", "4", "--weight-version", "start")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("transports")
    return {name: make_tiny_checkpoint(root / name, "qwen3", seed=i, with_tokenizer=False)
            for i, name in enumerate("abc")}


@pytest.fixture(scope="module")
def engines(ckpts: dict[str, Path]):
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: ServerProcess(ckpts["a"], *FLAGS), range(2)))
    yield started
    for srv in started:
        srv.close()


def weights(ckpt: Path) -> Named:
    return list(load_file(ckpt / "model.safetensors").items())


def make_transport(kind: str, urls: list[str], tmp_path: Path):
    if kind == "tensor":
        return TensorTransport(urls, timeout_s=30)
    if kind == "broadcast":
        return BroadcastTransport(urls, "gloo", timeout_s=30)
    if kind == "p2p":
        return P2PTransport(urls, "gloo", timeout_s=30)
    return DiskDeltaTransport(urls, tmp_path / "store", timeout_s=30)


@pytest.mark.parametrize("kind", ["tensor", "broadcast", "p2p", "disk-delta"])
def test_transport_passes_the_equality_check(kind, engines, ckpts, tmp_path) -> None:
    urls = [e.url for e in engines]
    sync = WeightSync(make_transport(kind, urls, tmp_path), BUCKET_BYTES,
                      check_equal_once=True, check_weight_update=True)
    try:
        named_b = weights(ckpts["b"])
        stats = sync.update(iter(named_b), f"{kind}-1")
        assert stats.verified and stats.tensors == len(named_b) and stats.buckets > 3
        assert not sync.check_equal_pending  # the noise check ran once
        # The second update changes one tensor only by a little: every transport delivers it.
        named_c = [(n, t.clone()) for n, t in named_b]
        named_c[3][1].view(-1)[:10] += 1.0
        stats = sync.update(iter(named_c), f"{kind}-2")
        assert stats.verified
        assert verify(named_c, urls) == len(named_c)
        if kind == "disk-delta":
            m = stats.metrics
            assert 0 < m["perf/update_weights_delta_changed_fraction"] < 0.01
            assert 0 < m["perf/update_weights_delta_bytes_written"] < 20_000
    finally:
        sync.close()


def test_a_transport_that_skips_a_tensor_fails_the_check(engines, ckpts) -> None:
    """The check's own negative case: the noise left in an unsent tensor is found."""
    urls = [e.url for e in engines]
    named = weights(ckpts["b"])
    dropped = "model.layers.0.mlp.up_proj.weight"
    partial = [(n, t) for n, t in named if n != dropped]
    with TensorTransport(urls, timeout_s=30) as transport:
        sync = WeightSync(transport, BUCKET_BYTES, check_equal_once=True)
        with pytest.raises(WeightMismatchError, match="never written") as err:
            sync.update(iter(partial), "partial")
        assert dropped in str(err.value)
        # Skipping it by name lets the same update pass.
        sync = WeightSync(transport, BUCKET_BYTES, check_equal_once=True,
                          check_skip=("model.layers.0.mlp.up_*",))
        assert sync.update(iter(partial), "partial-skipped").verified
        sync = WeightSync(transport, BUCKET_BYTES)
        sync.update(iter(named), "whole")  # leave the shared engines whole
