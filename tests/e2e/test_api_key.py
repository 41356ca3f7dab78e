"""`--api-key` on a real engine and on sglang-router in front of it (as the launcher starts them):
401 without the key, the same answers with it, /health open; milepost's weight transport sends
the key it was given. A whole `milepost train` run with a key (rollouts, broadcast updates and
their checksum checks through the keyed engines and router; its engines refuse a keyless request)
shares the loopback test's run: tests/e2e/test_loopback_listeners.py."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from milepost.auth import use_api_key
from milepost.launch.process import ManagedProcess, free_port
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.sync import WeightSync
from milepost.weights.transport import TensorTransport

KEY = "e2e-api-key-0123456789"
GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                      "ignore_eos": True}}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("key")
    model = make_tiny_checkpoint(root / "m", "qwen3", seed=0, with_tokenizer=False)
    with ServerProcess(model, "--max-total-tokens", "512", "--page-size", "4",
                       "--api-key", KEY) as srv:
        yield srv.url, root


def test_engine_refuses_requests_without_the_key(engine) -> None:
    url, root = engine
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    for path, body in (("/generate", GEN), ("/update_weights_from_disk",
                                            {"model_path": str(root / "m")}),
                       ("/flush_cache", None)):
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 401, (path, r.text)
        wrong = httpx.post(f"{url}{path}", json=body, timeout=30,
                           headers={"Authorization": "Bearer not-the-key"})
        assert wrong.status_code == 401
    assert httpx.get(f"{url}/get_model_info", timeout=30).status_code == 401
    assert httpx.post(f"{url}/generate", json=GEN, headers=AUTH, timeout=60).status_code == 200


def test_router_with_the_key_in_front_of_the_engine(engine, tmp_path: Path) -> None:
    url, _ = engine
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", url, "--policy", "manual",
           "--assignment-mode", "min_load", "--log-level", "warn", "--prometheus-host",
           "127.0.0.1", "--prometheus-port", str(free_port()), "--api-key", KEY]
    with ManagedProcess("router", cmd, tmp_path / "router.log",
                        f"http://127.0.0.1:{port}/health", timeout_s=180):
        router = f"http://127.0.0.1:{port}"
        assert httpx.post(f"{router}/generate", json=GEN, timeout=60).status_code == 401
        direct = httpx.post(f"{url}/generate", json=GEN, headers=AUTH, timeout=60).json()
        r = httpx.post(f"{router}/generate", json=GEN, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["output_ids"] == direct["output_ids"]


def test_weight_transport_sends_the_key(engine) -> None:
    url, root = engine
    named = list(load_file(root / "m" / "model.safetensors").items())
    use_api_key(KEY)
    try:
        sync = WeightSync(TensorTransport([url], timeout_s=60), 1 << 30)
        try:
            sync.update(iter(named), "keyed")
        finally:
            sync.close()
    finally:
        use_api_key(None)
    r = httpx.get(f"{url}/get_weight_version", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["weight_version"] == "keyed"

