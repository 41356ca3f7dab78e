"""Bad weight updates over p2p and disk-delta are refused with a message, and the engine keeps
serving its old weights (same greedy tokens, same weight_version): wrong names, shapes, dtypes;
a corrupt delta file; a version out of order; a version that was never fully published."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.disk_delta import DATA_NAME, DeltaWriter, version_dir
from milepost.weights.disk_transport import DiskDeltaTransport
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import TransportError
from milepost.weights.verify import verify

FLAGS = ("--max-total-tokens", "1024", "--page-size", "4")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("bad")
    a = make_tiny_checkpoint(root / "a", "qwen3", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(root / "b", "qwen3", seed=1, with_tokenizer=False)
    with ServerProcess(a, *FLAGS) as srv:
        yield srv.url, list(load_file(b / "model.safetensors").items()), root


def served(url: str) -> tuple[list[int], str]:
    r = httpx.post(f"{url}/generate", timeout=60, json={"input_ids": [5, 6, 7, 8, 9],
                   "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["weight_version"]


def corrupted(named, how: str):
    out = [(n, t.clone()) for n, t in named]
    n0, t0 = out[2]
    if how == "name":
        out[2] = ("model.layers.0.mlp.not_a_weight", t0)
    elif how == "shape":
        out[2] = (n0, t0[:-1].clone())
    else:
        out[2] = (n0, t0.to(torch.float16))
    return out, n0


@pytest.mark.parametrize("how", ["name", "shape", "dtype"])
def test_p2p_refuses_wrong_names_shapes_dtypes(setup, how) -> None:
    url, named, _ = setup
    before = served(url)
    bad, _ = corrupted(named, how)
    sync = WeightSync(P2PTransport([url], timeout_s=30), 1 << 30)  # one bucket: all or nothing
    try:
        with pytest.raises(TransportError) as err:
            sync.update(iter(bad), "bad")
        assert "weights unchanged" in str(err.value) and {"name": "unknown name", "shape":
               "shape mismatch", "dtype": "dtype mismatch"}[how] in str(err.value)
    finally:
        sync.close()
    assert served(url) == before


def test_p2p_ipc_bucket_to_a_cpu_engine_is_refused(setup) -> None:
    """A CUDA IPC bucket needs an engine on CUDA: a CPU engine answers 400 and keeps its weights."""
    url, named, _ = setup
    info = httpx.get(f"{url}/weights_p2p_info").json()  # what a source reads to choose IPC
    assert info == {"device": "cpu", "cuda_uuids": []}
    before = served(url)
    name, t = named[2]
    r = httpx.post(f"{url}/update_weights_from_p2p", timeout=30, json={
        "names": [name], "dtypes": [str(t.dtype).removeprefix("torch.")], "shapes": [list(t.shape)],
        "group_name": "none", "ipc_handle": "AAAA", "weight_version": "ipc"})
    assert r.status_code == 400 and "needs an engine on CUDA" in r.json()["message"], r.text
    assert served(url) == before


@pytest.mark.parametrize("how", ["name", "shape"])
def test_disk_delta_refuses_a_state_the_engine_model_cannot_take(setup, how, tmp_path) -> None:
    url, named, _ = setup
    before = served(url)
    bad, _ = corrupted(named, how)
    transport = DiskDeltaTransport([url], tmp_path / "store", timeout_s=30)
    sync = WeightSync(transport, 1 << 20)
    try:
        with pytest.raises(TransportError, match="no engine reloaded") as err:
            sync.update(iter(bad), "bad-base")
        assert "weights unchanged" in str(err.value)
    finally:
        sync.close()
    assert served(url) == before


def test_disk_delta_corrupt_out_of_order_and_partial_versions(setup, tmp_path) -> None:
    url, named, _ = setup
    store = tmp_path / "store"
    sync = WeightSync(DiskDeltaTransport([url], store, timeout_s=30), 1 << 20)
    try:
        sync.update(iter(named), "v0")  # the base, loaded by the engine
        assert verify(named, [url]) == len(named)
        stepped = [(n, t + 1e-3 if i % 3 == 0 else t) for i, (n, t) in enumerate(named)]
        sync.update(iter(stepped), "v1")
        before = served(url)
        assert before[1] == "v1"
    finally:
        sync.close()
    w = DeltaWriter(store)  # a second writer lineage on the same store: starts a full version
    w.version, w.snapshot = 1, {n: t.clone() for n, t in stepped}  # pretend to continue from v1
    for k in (2, 3):
        w.begin(f"v{k}")
        for n, t in stepped:
            w.add(n, t + k * 1e-3)
        w.commit()

    def prepare(version: int) -> httpx.Response:
        return httpx.post(f"{url}/weights_delta/prepare", timeout=60,
                          json={"root": str(store), "version": version})

    r = prepare(3)  # out of order: the engine holds 1
    assert r.status_code == 400 and "applies on top of version 2" in r.json()["message"]
    data = version_dir(store, 2) / DATA_NAME
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x55
    data.write_bytes(bytes(raw))
    r = prepare(2)  # corrupt
    assert r.status_code == 400 and ("corrupt" in r.json()["message"]
                                     or "digest differs" in r.json()["message"])
    version_dir(store, 4).mkdir()
    (version_dir(store, 4) / DATA_NAME).write_bytes(b"half a file")
    r = prepare(4)  # never published (no index)
    assert r.status_code == 400 and "not published" in r.json()["message"]
    assert httpx.post(f"{url}/weights_delta/commit", json={"version": 2}, timeout=30
                      ).status_code == 400
    assert served(url) == before
