"""WeightLoader: all-or-nothing updates from serialized tensors, disk and a weight group.

Run as a script, this file is the other process of the two-process tests (trainer or IPC receiver).
"""

from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from milepost.engine.weight_update import WeightLoader, WeightUpdateError, parse_dtype
from milepost.weights.codec import deserialize_named_tensors, serialize_named_tensors
from milepost.weights.process_group import init_weight_group
from milepost.weights.sender import broadcast_named_tensors, describe_named_tensors

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30.0


class TinyModel(nn.Module):
    """Stand-in for a native model: q/k/v share one fused parameter, as real engines lay them out."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(16, 8, generator=g).to(dtype))
        self.qkv = nn.Parameter(torch.randn(8 + 4 + 4, 8, generator=g).to(dtype))  # rows: q 8, k 4, v 4
        self.norm = nn.Parameter(torch.randn(8, generator=g).to(dtype))
        self._rows = {"q": (0, 8), "k": (8, 12), "v": (12, 16)}

    def weight_view(self, hf_name: str) -> torch.Tensor:
        if hf_name == "model.embed_tokens.weight":
            return self.embed
        if hf_name == "model.norm.weight":
            return self.norm
        for p, (a, b) in self._rows.items():
            if hf_name == f"model.layers.0.self_attn.{p}_proj.weight":
                return self.qkv[a:b]
        raise KeyError(f"{hf_name!r} is not a weight of TinyModel")

    def hf_weight_names(self) -> list[str]:
        return ["model.embed_tokens.weight", "model.norm.weight"] + [
            f"model.layers.0.self_attn.{p}_proj.weight" for p in self._rows
        ]


def checkpoint(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A full update's worth of (hf_name, tensor), detached copies."""
    return [(n, model.weight_view(n).detach().clone()) for n in model.hf_weight_names()]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed by a refused update"


def assert_holds(model: nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    for n, t in named:
        assert torch.equal(model.weight_view(n), t.to(model.weight_view(n).dtype)), n


def test_full_update_applies() -> None:
    model, new = TinyModel(seed=0), checkpoint(TinyModel(seed=1))
    assert WeightLoader(model).from_named(new, strict_dtype=True) == len(new)
    assert_holds(model, new)
    assert model.qkv.requires_grad  # the copy happened under no_grad and kept the parameter


def test_codec_round_trip_through_loader() -> None:
    big = torch.randn(100, 8)
    named = [("model.embed_tokens.weight", big[:16]), ("model.norm.weight", torch.randn(8))]
    data = serialize_named_tensors(named)
    # A slice is compacted: the payload does not carry the 100-row buffer behind it.
    assert len(base64.b64decode(data)) < big.numel() * 4
    back = deserialize_named_tensors(data)
    assert [n for n, _ in back] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, named))
    model = TinyModel()
    assert WeightLoader(model).from_tensors(data, strict_dtype=True) == 2
    assert_holds(model, named)


@pytest.mark.parametrize(
    "payload, match",
    [
        ("not base64 at all!", "not valid base64"),
        (base64.b64encode(b"\x80\x05garbage").decode(), "not a readable pickle"),
        (base64.b64encode(pickle.dumps({"a": torch.zeros(1)})).decode(), "list of \\(name, tensor\\)"),
        (base64.b64encode(pickle.dumps([("a", [1.0])])).decode(), "item 0 must be a \\(str, Tensor\\)"),
    ],
    # a pickled tensor's bytes differ between processes: ids from them break xdist's collection check
    ids=["not-base64", "not-a-pickle", "a-dict", "not-a-tensor"],
)
def test_bad_payloads_raise_weight_update_error(payload: str, match: str) -> None:
    model = TinyModel()
    before = snapshot(model)
    with pytest.raises(WeightUpdateError, match=match):
        WeightLoader(model).from_tensors(payload)
    assert_unchanged(model, before)


def test_one_bad_shape_among_many_changes_nothing() -> None:
    model = TinyModel()
    before = snapshot(model)
    new = checkpoint(TinyModel(seed=1))
    new[3] = (new[3][0], torch.randn(5, 8))  # k_proj is [4, 8]
    with pytest.raises(WeightUpdateError) as err:
        WeightLoader(model).from_named(new)
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight: shape mismatch, model expects [4, 8], got [5, 8]" in msg
    assert "1 problems" in msg and "no weight was changed" in msg
    assert_unchanged(model, before)


def test_unknown_name_is_listed_with_a_hint() -> None:
    model = TinyModel()
    before = snapshot(model)
    new = checkpoint(TinyModel(seed=1)) + [("model.layers.0.self_attn.o_proj.weight", torch.zeros(8, 8))]
    new.append(("model.layers.0.self_attn.q_proj.weigth", torch.zeros(8, 8)))
    with pytest.raises(WeightUpdateError) as err:
        WeightLoader(model).from_named(new)
    msg = str(err.value)
    assert "model.layers.0.self_attn.o_proj.weight: unknown name for this model" in msg
    assert "is not a weight of TinyModel" in msg  # the model's own explanation is kept
    assert "did you mean 'model.layers.0.self_attn.q_proj.weight'" in msg
    assert "2 problems" in msg
    assert_unchanged(model, before)


def test_dtype_mismatch_strict_refuses_and_lenient_casts() -> None:
    model = TinyModel(dtype=torch.bfloat16)
    before = snapshot(model)
    new = checkpoint(TinyModel(seed=1))  # float32
    with pytest.raises(WeightUpdateError) as err:
        WeightLoader(model).from_named(new, strict_dtype=True)
    expected = "model.norm.weight: dtype mismatch, model expects torch.bfloat16, got torch.float32"
    assert expected in str(err.value)
    assert f"{len(new)} problems" in str(err.value)
    assert_unchanged(model, before)
    WeightLoader(model).from_named(new, strict_dtype=False)
    assert_holds(model, new)
    assert model.norm.dtype == torch.bfloat16
    with pytest.raises(WeightUpdateError, match="cannot cast torch.int64"):
        WeightLoader(model).from_named([("model.norm.weight", torch.zeros(8, dtype=torch.int64))])


def test_stage_copies_nothing_and_duplicates_are_refused() -> None:
    model = TinyModel()
    before = snapshot(model)
    loader = WeightLoader(model)
    pairs = loader.stage(checkpoint(TinyModel(seed=1)), strict_dtype=True)
    assert len(pairs) == 5
    assert_unchanged(model, before)
    dup = [("model.norm.weight", torch.zeros(8)), ("model.norm.weight", torch.ones(8))]
    with pytest.raises(WeightUpdateError, match="appears twice"):
        loader.stage(dup, strict_dtype=True)


def test_disk_load_casts_and_checks(tmp_path: Path) -> None:
    new = checkpoint(TinyModel(seed=1))
    bf16 = {n: t.to(torch.bfloat16) for n, t in new}
    names = list(bf16)
    save_file({n: bf16[n] for n in names[:2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: bf16[n] for n in names[2:]}, tmp_path / "model-00002-of-00002.safetensors")
    model = TinyModel()  # float32
    assert WeightLoader(model).from_disk(str(tmp_path)) == 5
    assert_holds(model, list(bf16.items()))
    assert model.qkv.dtype == torch.float32

    partial = tmp_path / "partial"
    partial.mkdir()
    save_file({n: bf16[n] for n in names[:2]}, partial / "model.safetensors")
    model = TinyModel()
    before = snapshot(model)
    with pytest.raises(WeightUpdateError, match=r"self_attn.q_proj.weight: missing from"):
        WeightLoader(model).from_disk(str(partial))
    assert_unchanged(model, before)
    assert WeightLoader(model).from_disk(str(partial), require_complete=False) == 2

    with pytest.raises(WeightUpdateError, match="is not a directory"):
        WeightLoader(model).from_disk(str(tmp_path / "nothing_here"))


def test_disk_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightUpdateError, match="holds no \\*.safetensors"):
        WeightLoader(TinyModel()).from_disk(str(tmp_path))


def test_parse_dtype_accepts_sglang_spellings() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float8_e4m3fn") is torch.float8_e4m3fn
    with pytest.raises(WeightUpdateError, match="unknown dtype 'bf16'"):
        parse_dtype("bf16")


class _MustNotReceive:
    device = torch.device("cpu")

    def broadcast(self, *a: object, **k: object) -> None:
        raise AssertionError("received despite malformed metadata")

    broadcast_many = broadcast


def test_distributed_malformed_metadata_raises_before_receiving() -> None:
    loader, group = WeightLoader(TinyModel()), _MustNotReceive()
    with pytest.raises(WeightUpdateError, match="model.norm.weight: unknown dtype 'bf16'"):
        loader.from_distributed(group, ["model.norm.weight"], ["bf16"], [[8]])  # type: ignore[arg-type]
    with pytest.raises(WeightUpdateError, match="one entry per tensor"):
        loader.from_distributed(group, ["model.norm.weight"], [], [[8]])  # type: ignore[arg-type]
    with pytest.raises(WeightUpdateError, match="not a list of sizes"):
        loader.from_distributed(group, ["model.norm.weight"], ["float32"], [[-8]])  # type: ignore[arg-type]


def test_distributed_update_across_two_processes(tmp_path: Path) -> None:
    good = checkpoint(TinyModel(seed=1))
    bad = checkpoint(TinyModel(seed=2))
    bad[1] = ("model.layers.0.self_attn.x_proj.weight", torch.randn(4, 8))
    torch.save([bad, good], tmp_path / "buckets.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    trainer = subprocess.Popen(
        [sys.executable, __file__, "trainer", str(port), str(tmp_path / "buckets.pt")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    model = TinyModel()
    before = snapshot(model)
    loader = WeightLoader(model)
    with init_weight_group("127.0.0.1", port, 1, 2, "weight_update_group", "gloo", TIMEOUT_S) as group:
        # A refused bucket is still drained, so the trainer's broadcasts finish and the group lives on.
        with pytest.raises(WeightUpdateError, match="x_proj.weight: unknown name"):
            loader.from_distributed(group, *describe_named_tensors(bad), strict_dtype=True)
        assert_unchanged(model, before)
        names, dtypes, shapes = describe_named_tensors(good)
        dtypes = [f"torch.{d}" for d in dtypes]  # SGLang clients send either spelling
        assert loader.from_distributed(group, names, dtypes, shapes, strict_dtype=True) == 5
    out, _ = trainer.communicate(timeout=60)
    assert trainer.returncode == 0, out
    assert_holds(model, good)


def test_real_tiny_checkpoints_update_from_disk_and_tensors(tmp_path: Path) -> None:
    registry = pytest.importorskip("milepost.models.registry")
    checkpoints = pytest.importorskip("milepost.testing.checkpoints")
    for arch in ("qwen3", "qwen3_moe"):  # moe: fused expert names fill per-expert weights
        old = checkpoints.make_tiny_checkpoint(tmp_path / f"{arch}_0", arch, seed=0, with_tokenizer=False)
        new = checkpoints.make_tiny_checkpoint(tmp_path / f"{arch}_1", arch, seed=1, with_tokenizer=False)
        model = registry.load_model(old, torch.float32, "cpu")
        reference = registry.load_model(new, torch.float32, "cpu")
        loader = WeightLoader(model)
        assert loader.from_disk(str(new)) > 0
        for name in model.hf_weight_names():
            assert torch.equal(model.weight_view(name), reference.weight_view(name)), (arch, name)
        named = [(n, reference.weight_view(n).clone() * 2) for n in model.hf_weight_names()[:3]]
        loader.from_tensors(serialize_named_tensors(named), strict_dtype=True)
        assert_holds(model, named)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_travel_as_ipc_handles_to_another_process(tmp_path: Path) -> None:
    new = [(n, t.cuda()) for n, t in checkpoint(TinyModel(seed=1))]
    data = serialize_named_tensors(new)
    assert len(data) < 4096  # handles, not bytes
    (tmp_path / "payload.txt").write_text(data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    receiver = subprocess.run(
        [sys.executable, __file__, "ipc_receiver", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # `new` stays alive here until the receiver has copied from it
    assert receiver.returncode == 0, receiver.stdout + receiver.stderr
    got = torch.load(tmp_path / "received.pt")
    for n, t in new:
        assert torch.equal(got[n], t.cpu()), n


def _ipc_receiver(out: Path) -> None:
    model = TinyModel().cuda()
    WeightLoader(model).from_tensors((out / "payload.txt").read_text(), strict_dtype=True)
    torch.cuda.synchronize()
    torch.save({n: model.weight_view(n).cpu() for n in model.hf_weight_names()}, out / "received.pt")


def _trainer(port: int, buckets_path: str) -> None:
    """Rank 0 of the distributed test: broadcasts each bucket, as the trainer would."""
    with init_weight_group("127.0.0.1", port, 0, 2, "weight_update_group", "gloo", TIMEOUT_S) as g:
        for bucket in torch.load(buckets_path):
            broadcast_named_tensors(g, bucket)


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        _trainer(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "ipc_receiver":
        _ipc_receiver(Path(sys.argv[2]))
