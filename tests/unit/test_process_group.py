"""Weight groups between real processes on loopback: bit-exact broadcast, re-creation, isolation.

The test process is rank 0 (the trainer); this file run as a script is rank 1 (an engine).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from milepost.weights.codec import WeightUpdateError
from milepost.weights.process_group import BackendName, WeightGroupRegistry, init_weight_group

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_peer(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(peer: subprocess.Popen) -> str:
    out, _ = peer.communicate(timeout=60)
    assert peer.returncode == 0, out
    return out


def sample_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(5, 7, generator=g)
    f32[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return [
        f32,
        torch.randn(3, 4, generator=g).to(torch.bfloat16),
        torch.randn(6, generator=g).to(torch.float16),
        torch.randint(-(2**62), 2**62, (4, 2), generator=g, dtype=torch.int64),
        torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        torch.rand(5, generator=g) > 0.5,
        torch.randn(8, generator=g).to(torch.float8_e4m3fn),  # gloo lacks fp8: sent as bytes
        torch.randn(4, 6, generator=g).t(),  # non-contiguous
        torch.empty(0, 3),
        torch.tensor(3.5, dtype=torch.float64),  # 0-d
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_broadcast_arrives_bit_exactly(tmp_path: Path) -> None:
    sent = sample_tensors()
    torch.save(sent, tmp_path / "specs.pt")
    port = free_port()
    peer = start_peer("receive", str(port), str(tmp_path))
    with init_weight_group("127.0.0.1", port, 0, 2, "bitexact", "gloo", TIMEOUT_S) as group:
        group.broadcast(sent[0])
        group.broadcast_many(sent[1:])
    finish(peer)
    got = torch.load(tmp_path / "received.pt")
    assert len(got) == len(sent)
    for s, r in zip(sent, got):
        assert r.dtype == s.dtype and r.shape == s.shape
        assert torch.equal(bits(r), bits(s)), s.dtype


def test_new_group_after_close_and_with_own_default_group(tmp_path: Path) -> None:
    port = free_port()
    peer = start_peer("reopen", str(port), str(tmp_path))
    for round_ in range(2):  # the same port twice: close must free rank 0's store
        with init_weight_group("127.0.0.1", port, 0, 2, f"round{round_}", "gloo", TIMEOUT_S) as group:
            group.broadcast(torch.full((3,), float(round_ + 1)))
        assert group.closed
        (tmp_path / f"closed{round_}").touch()  # the peer joins the next round only now
    out = finish(peer)
    assert "round0 [1.0, 1.0, 1.0]" in out and "round1 [2.0, 2.0, 2.0]" in out, out
    assert "default group intact" in out, out


def test_registry_by_name() -> None:
    registry = WeightGroupRegistry()
    port = free_port()
    group = registry.init("127.0.0.1", port, 0, 1, "solo", "gloo", TIMEOUT_S)
    assert registry.get("solo") is group and registry.names() == ["solo"]
    with pytest.raises(WeightUpdateError, match="already open"):
        registry.init("127.0.0.1", port, 0, 1, "solo", "gloo", TIMEOUT_S)
    t = torch.arange(4.0)
    group.broadcast(t)  # world of one: a no-op that must still work
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    registry.destroy("solo")
    assert group.closed and registry.names() == []
    with pytest.raises(WeightUpdateError, match="init_weights_update_group"):
        registry.get("solo")
    with pytest.raises(WeightUpdateError, match="closed"):
        group.broadcast(t)
    registry.close()


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(WeightUpdateError, match="rank 2 is outside world_size 2"):
        init_weight_group("127.0.0.1", free_port(), 2, 2, "g", "gloo")
    with pytest.raises(WeightUpdateError, match="backend"):
        init_weight_group("127.0.0.1", free_port(), 0, 2, "g", "mpi")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(WeightUpdateError, match="nccl"):
            init_weight_group("127.0.0.1", free_port(), 0, 2, "g", "nccl")
    with init_weight_group("127.0.0.1", free_port(), 0, 1, "g", "gloo", TIMEOUT_S) as group:
        with pytest.raises(ValueError, match="outside group"):
            group.broadcast(torch.zeros(1), src=1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_broadcast_between_two_gpus(tmp_path: Path) -> None:
    sent = sample_tensors()
    torch.save(sent, tmp_path / "specs.pt")
    port = free_port()
    peer = start_peer("receive_nccl", str(port), str(tmp_path))
    torch.cuda.set_device(0)
    with init_weight_group("127.0.0.1", port, 0, 2, "nccl_bitexact", "nccl", TIMEOUT_S) as group:
        group.broadcast(sent[0].cuda())
        group.broadcast_many([t.cuda() for t in sent[1:]])
        torch.cuda.synchronize()
    finish(peer)
    got = torch.load(tmp_path / "received.pt")
    for s, r in zip(sent, got):
        assert r.dtype == s.dtype and r.shape == s.shape
        assert torch.equal(bits(r), bits(s)), s.dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_group_of_one_builds_and_broadcasts() -> None:
    # Two NCCL ranks cannot share one GPU; a group of one still exercises construction and the
    # lazily created communicator on machines with a single device.
    torch.cuda.set_device(0)
    sent = [t.cuda() for t in sample_tensors()]
    with init_weight_group("127.0.0.1", free_port(), 0, 1, "nccl_solo", "nccl", TIMEOUT_S) as group:
        assert group.device == torch.device("cuda", 0)
        copies = [t.clone() for t in sent]
        group.broadcast_many(copies)
        with pytest.raises(ValueError, match="must be on CUDA"):
            group.broadcast(torch.zeros(2))
    for s, r in zip(sent, copies):
        assert torch.equal(bits(r), bits(s))


# -- rank 1, run as a script --------------------------------------------------------------------


def _receive(port: int, out: Path, backend: str) -> None:
    specs = torch.load(out / "specs.pt")
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(1)
        device = "cuda:1"
    # Receive into zeros of each shape (a transposed view for the non-contiguous one).
    recv = [torch.zeros(t.shape, dtype=t.dtype, device=device) for t in specs]
    recv[7] = torch.zeros(tuple(reversed(specs[7].shape)), dtype=specs[7].dtype, device=device).t()
    name = "nccl_bitexact" if backend == "nccl" else "bitexact"
    kind: BackendName = "nccl" if backend == "nccl" else "gloo"
    with init_weight_group("127.0.0.1", port, 1, 2, name, kind, TIMEOUT_S) as group:
        group.broadcast(recv[0])
        group.broadcast_many(recv[1:])
    torch.save([t.cpu() for t in recv], out / "received.pt")


def _reopen(port: int, out: Path) -> None:
    import time

    import torch.distributed as dist

    # This process has its own default group (as an FSDP trainer would); weight groups ignore it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    for round_ in range(2):
        # Not before rank 0 closed the last round's store: a client that reached that store
        # while it was still up would wait on it after it closed (the race a loaded machine hit).
        deadline = time.monotonic() + 60
        while round_ and not (out / f"closed{round_ - 1}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t = torch.zeros(3)
        with init_weight_group("127.0.0.1", port, 1, 2, f"round{round_}", "gloo", TIMEOUT_S) as group:
            group.broadcast(t)
        print(f"round{round_} {t.tolist()}")
    x = torch.ones(2)
    dist.all_reduce(x)
    assert dist.get_world_size() == 1 and x.tolist() == [1.0, 1.0]
    dist.destroy_process_group()
    print("default group intact")


if __name__ == "__main__":
    role, port_arg, out_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if role == "receive":
        _receive(port_arg, out_dir, "gloo")
    elif role == "receive_nccl":
        _receive(port_arg, out_dir, "nccl")
    elif role == "reopen":
        _reopen(port_arg, out_dir)
