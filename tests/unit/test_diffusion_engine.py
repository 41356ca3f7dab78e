"""The diffusion engine and its HTTP routes (milepost/diffusion/engine.py, server.py) on a tiny
random DiT: trajectories in both formats, weight updates checked before anything changes, LoRA
merged on arrival, and bad requests answered 400 naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from milepost.diffusion import lora
from milepost.diffusion.codec import CONTENT_TYPE, from_json, unpack
from milepost.diffusion.engine import DiffusionEngine
from milepost.diffusion.model import DiTConfig, TinyDiT, load_model, save_model
from milepost.diffusion.server import create_app
from milepost.weights.codec import WeightUpdateError, serialize_named_tensors
from milepost.weights.verify import digest_named

torch.set_num_threads(1)


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(dim=16, depth=1, heads=2))
    for p in model.parameters():  # non-zero everywhere, so outputs depend on every weight
        torch.nn.init.normal_(p, std=0.05)
    return save_model(model, tmp_path / "dit")


def test_generate_bytes_and_json_agree(model_dir: Path) -> None:
    client = TestClient(create_app(DiffusionEngine(model_dir)))
    body = {"labels": [0, 0, 2], "seed": 5, "num_steps": 3, "guidance_scale": 2.0}
    raw = client.post("/generate", json=body)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith(CONTENT_TYPE)
    meta, arrays = unpack(raw.content)
    assert meta["weight_version"] == "0" and arrays["latents"].shape == (3, 4, 3, 32, 32)
    assert arrays["log_probs"].shape == (3, 3) and np.isfinite(arrays["log_probs"]).all()
    _, js = from_json(client.post("/generate", json={**body, "return_format": "json"}).content)
    assert np.array_equal(js["latents"], arrays["latents"])  # same seed, same batch: same trajectory
    bad = client.post("/generate", json={**body, "labels": [7]})
    assert bad.status_code == 400 and "labels" in bad.json()["error"]["message"]
    bad = client.post("/generate", json={**body, "num_steps": 0})
    assert bad.status_code == 400 and "num_steps" in bad.json()["error"]["message"]


def test_weight_update_is_checked_then_applied(model_dir: Path) -> None:
    engine = DiffusionEngine(model_dir)
    client = TestClient(create_app(engine))
    before = digest_named(engine.model.state_dict().items())
    wrong = [("blocks.0.qkv.weight", torch.zeros(3, 3)), ("nope.weight", torch.zeros(1))]
    r = client.post("/update_weights_from_tensor",
                    json={"serialized_named_tensors": [serialize_named_tensors(wrong)], "weight_version": "9"})
    assert r.status_code == 400
    assert "blocks.0.qkv.weight: shape (3, 3)" in r.text and "nope.weight: unknown weight" in r.text
    assert digest_named(engine.model.state_dict().items()) == before and engine.weight_version == "0"
    new = {k: v + 1 for k, v in load_model(model_dir).state_dict().items()}
    r = client.post("/update_weights_from_tensor",
                    json={"serialized_named_tensors": [serialize_named_tensors(list(new.items()))], "weight_version": "1"})
    assert r.status_code == 200 and r.json()["weight_version"] == "1"
    sums = client.get("/weights_checksum").json()
    assert sums["checksums"] == digest_named(new.items())


def test_lora_is_merged_on_arrival_and_replaced(model_dir: Path) -> None:
    engine = DiffusionEngine(model_dir)
    trainer_model = load_model(model_dir)
    base = trainer_model.blocks[0].qkv.weight.detach().clone()
    lora.attach_lora(trainer_model, rank=2, alpha=4.0)
    for step in range(2):  # the second adapter replaces the first (merged onto the same base)
        with torch.no_grad():
            for m in trainer_model.modules():
                if isinstance(m, lora.LoraLinear):
                    m.lora_B.normal_(std=0.1)
        engine.load_named(lora.adapter_tensors(trainer_model), str(step + 1))
        expected = lora.merged_state(trainer_model)
        assert digest_named(engine.model.state_dict().items()) == digest_named(expected.items())
    qkv = trainer_model.blocks[0].qkv
    torch.testing.assert_close(engine.model.blocks[0].qkv.weight, base + (qkv.lora_B * qkv.scale) @ qkv.lora_A)
    with pytest.raises(WeightUpdateError, match="send both lora_A and lora_B"):
        engine.load_named([("blocks.0.qkv.lora_A.weight", torch.zeros(2, 16))], "3")


def test_not_a_flow_matching_model_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "unet2d", "scheduler": "ddpm"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="flow-matching scheduler"):
        load_model(tmp_path)


def test_broadcast_update_is_checked_then_applied(model_dir: Path) -> None:
    """--weight-transport broadcast: the text engine's BroadcastTransport over a real gloo group to a
    live engine server; a bucket the engine refuses changes nothing, a good one lands whole."""
    import threading
    import time

    import uvicorn

    from milepost.launch.process import free_port
    from milepost.weights.transport import BroadcastTransport, TransportError

    engine = DiffusionEngine(model_dir)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "engine server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        before = digest_named(engine.model.state_dict().items())
        with BroadcastTransport([url], "gloo", timeout_s=120) as bad:
            bad.begin("1")
            with pytest.raises(TransportError, match=r"blocks.0.qkv.weight: shape \(3, 3\)"):
                bad.send([("blocks.0.qkv.weight", torch.zeros(3, 3))], last=True)
        assert digest_named(engine.model.state_dict().items()) == before and engine.weight_version == "0"
        new = [(k, v + 1) for k, v in load_model(model_dir).state_dict().items()]
        with BroadcastTransport([url], "gloo", timeout_s=120) as good:
            good.begin("1")
            good.send(new[:3])  # two buckets: the version moves with the last
            good.send(new[3:], last=True)
            good.finish("1")
        assert engine.weight_version == "1" and digest_named(engine.model.state_dict().items()) == digest_named(new)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
