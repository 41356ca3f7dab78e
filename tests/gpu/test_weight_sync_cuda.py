"""WeightSync from CUDA trainer tensors to a bf16 engine on CUDA: IPC handoff and broadcast.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu`. The trainer's tensors
are fp32 on the GPU and cast to the engine's bf16 on the way (an asynchronous kernel right before
the handoff, which the transport must wait for); the checksum check proves every bit arrived.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.sync import WeightSync
from milepost.weights.transport import BroadcastTransport, TensorTransport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BUCKET_BYTES = 40_000  # smaller than the embedding (512 x 64 bf16 = 65536 bytes)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sync_cuda")
    return {n: make_tiny_checkpoint(root / n, "qwen3", seed=i, with_tokenizer=False)
            for i, n in enumerate("ab")}


def engine(ckpt: Path) -> ServerProcess:
    return ServerProcess(ckpt, "--device", "cuda", "--dtype", "bfloat16",
                         "--max-total-tokens", "1024", "--mem-fraction-static", "0.1")


def trainer_weights(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.to("cuda:0")) for n, t in load_file(ckpt / "model.safetensors").items()]


def generate(url: str) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=60, json={"input_ids": [5, 17, 300, 42], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("kind", ["tensor", "gloo"])
def test_cuda_trainer_to_cuda_engine(ckpts, kind: str) -> None:
    with engine(ckpts["b"]) as ref, engine(ckpts["a"]) as srv:
        want = generate(ref.url)
        assert generate(srv.url) != want
        transport = (TensorTransport([srv.url], timeout_s=60) if kind == "tensor"
                     else BroadcastTransport([srv.url], "gloo", timeout_s=60))
        sync = WeightSync(transport, BUCKET_BYTES, dtype=torch.bfloat16, check_weight_update=True)
        try:
            for version in ("v1", "v2"):
                stats = sync.update(trainer_weights(ckpts["b"]), version)
                assert stats.verified and stats.buckets > 2
                assert generate(srv.url) == want
        finally:
            sync.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs the engine on another GPU")
def test_nccl_broadcast_to_an_engine_on_another_gpu(ckpts, monkeypatch) -> None:
    torch.cuda.set_device(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the engines' processes see GPU 1 only
    with engine(ckpts["b"]) as ref, engine(ckpts["a"]) as srv:
        want = generate(ref.url)
        sync = WeightSync(BroadcastTransport([srv.url], "nccl", timeout_s=60), BUCKET_BYTES,
                          dtype=torch.bfloat16, check_weight_update=True)
        try:
            for version in ("n1", "n2"):
                stats = sync.update(trainer_weights(ckpts["b"]), version)
                assert stats.verified and stats.buckets > 2
                assert generate(srv.url) == want
        finally:
            sync.close()
