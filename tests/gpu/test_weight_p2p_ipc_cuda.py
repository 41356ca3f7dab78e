"""P2P over CUDA IPC on ONE GPU: the trainer (this process) and an engine process share the device.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_weight_p2p_ipc_cuda.py`.
P2PTransport with backend nccl must pick the CUDA IPC path by itself (same host, engine on CUDA;
NCCL could not even connect two ranks on one GPU), pass the equality check (engine filled with
noise, then bit for bit) and generate what an engine loaded from the same checkpoint generates.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync
from milepost.weights.verify import verify

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BUCKET_BYTES = 40_000  # several buckets; the embedding (65536 bytes in bf16) travels alone


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("p2p_ipc")
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


def test_p2p_picks_cuda_ipc_on_one_gpu_and_passes_the_equality_check(ckpts) -> None:
    torch.cuda.set_device(0)
    with engine(ckpts["b"]) as ref, engine(ckpts["a"]) as srv:
        want = generate(ref.url)
        assert generate(srv.url) != want
        transport = P2PTransport([srv.url], "nccl", timeout_s=60)  # ipc=None: chosen by itself
        sync = WeightSync(transport, BUCKET_BYTES, dtype=torch.bfloat16, check_equal_once=True,
                          check_weight_update=True)
        try:
            stats = sync.update(trainer_weights(ckpts["b"]), "ipc-1")
            assert transport.path == "cuda-ipc" and transport._group is None  # no NCCL group
            assert stats.verified and stats.buckets > 2 and not sync.check_equal_pending
            assert generate(srv.url) == want
            # A second update that changes one tensor: the reused staging buffer carries it.
            named = trainer_weights(ckpts["b"])
            named[3][1].view(-1)[:10] += 1.0
            assert sync.update(named, "ipc-2").verified
            assert verify([(n, t.to(torch.bfloat16)) for n, t in named], [srv.url]) == len(named)
            assert transport.bytes_sent >= 2 * stats.bytes
        finally:
            sync.close()


def test_ipc_required_but_the_engine_is_on_cpu_is_refused(ckpts) -> None:
    """ipc=True where CUDA IPC cannot work says why instead of falling back silently."""
    from milepost.weights.transport import TransportError

    with ServerProcess(ckpts["a"], "--device", "cpu", "--max-total-tokens", "256") as cpu_engine:
        transport = P2PTransport([cpu_engine.url], "nccl", timeout_s=30, ipc=True)
        try:
            with pytest.raises(TransportError, match="engines not on CUDA"):
                transport.begin("never")
        finally:
            transport.close()


def test_fp8_engine_on_cuda_takes_ipc_updates_within_the_format_bound(ckpts) -> None:
    """`--quantization fp8` on CUDA (CUDA graphs on): updates over CUDA IPC are quantized on
    arrival and pass the equality check within the e4m3 bound; the engine still generates."""
    with ServerProcess(ckpts["a"], "--device", "cuda", "--dtype", "bfloat16", "--max-total-tokens",
                       "1024", "--mem-fraction-static", "0.1", "--quantization", "fp8") as srv:
        sync = WeightSync(P2PTransport([srv.url], "nccl", timeout_s=60), BUCKET_BYTES,
                          dtype=torch.bfloat16, check_equal_once=True, check_weight_update=True)
        try:
            assert sync.update(trainer_weights(ckpts["b"]), "fp8-1").verified
            assert sync.transport.path == "cuda-ipc"
        finally:
            sync.close()
        assert len(generate(srv.url)) == 8
