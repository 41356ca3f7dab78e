"""Release and resume of a real `milepost serve` process's memory (KV pool, weights), over HTTP.

Checks that the storage is really freed (the server's tensors hold 0 bytes and the process's
resident memory drops by the KV pool's size), that generation and weight calls are refused while
released, that resume brings back exactly the same model (greedy output identical), and the 400s
for bad tags and for a release while a request holds KV.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess

POOL_TOKENS = 262144  # tiny Qwen3: 2 layers x 2 KV heads x 16 dims x fp32 x (K, V) = 512 B/token
KV_BYTES = POOL_TOKENS * 512  # 128 MiB: large enough to see in the process's resident memory
PROMPT = [5, 17, 250, 33, 101, 7, 64, 300, 12, 48]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("memory"), "qwen3", with_tokenizer=False)
    with ServerProcess(Path(path), "--max-total-tokens", str(POOL_TOKENS)) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        c.post("/resume_memory_occupation", json={})  # leave the next test a whole server
        c.post("/continue_generation")


def _greedy(client: httpx.Client, n: int = 24) -> dict:
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_release_frees_refuses_and_resume_restores(server: ServerProcess, client: httpx.Client) -> None:
    before = _greedy(client)
    held = client.get("/memory_occupation").json()["held_bytes"]
    assert held["kv_cache"] == KV_BYTES and held["weights"] > 0
    rss = _rss_bytes(server.proc.pid)

    r = client.post("/release_memory_occupation", json={})  # no tags: both
    assert r.status_code == 200, r.text
    assert r.json()["freed_bytes"] == KV_BYTES + held["weights"]
    state = client.get("/memory_occupation").json()
    assert state["released"] == ["kv_cache", "weights"]
    assert state["held_bytes"] == {"kv_cache": 0, "weights": 0}
    assert _rss_bytes(server.proc.pid) < rss - 0.8 * KV_BYTES, "the KV pool went back to the OS"

    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503 and "resume_memory_occupation" in r.text
    r = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert r.status_code == 400 and "weights are released" in r.text
    assert client.post("/continue_generation").status_code == 400
    assert client.get("/health").status_code == 200

    r = client.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache"]
    assert client.get("/memory_occupation").json()["held_bytes"]["weights"] == held["weights"]
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503, "still no KV pool"
    r = client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json()["released"] == []
    assert client.get("/memory_occupation").json()["held_bytes"] == held

    after = _greedy(client)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["cached_tokens"] == 0, "release flushed the prefix cache"


def test_weights_only_release_keeps_kv_and_updates_wait_for_resume(client: httpx.Client) -> None:
    before = _greedy(client, 8)
    r = client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 200 and r.json()["released"] == ["weights"]
    held = client.get("/memory_occupation").json()["held_bytes"]
    assert held["weights"] == 0 and held["kv_cache"] == KV_BYTES
    again = client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert again.status_code == 200 and again.json()["freed_bytes"] == 0, "already released: no-op"
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert _greedy(client, 8)["output_ids"] == before["output_ids"]


@pytest.mark.parametrize("body", [{"tags": ["kv"]}, {"tags": []}, {"tags": "weights"},
                                  {"tag": ["weights"]}])
def test_bad_tags_are_400(client: httpx.Client, body: dict) -> None:
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "tag" in r.json()["error"]["message"]
    assert client.get("/memory_occupation").json()["released"] == []


def test_release_is_refused_while_a_request_holds_kv(client: httpx.Client) -> None:
    result: dict = {}

    def run() -> None:
        result["r"] = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 1900, "temperature": 0.0, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 180  # idle: well under a second; a loaded machine is far slower
    while client.get("/get_server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    client.post("/pause_generation", json={"mode": "in_place"})  # hold it with its KV
    r = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 400 and "hold KV cache" in r.text
    assert client.get("/memory_occupation").json()["released"] == []
    client.post("/continue_generation")
    t.join(180)
    assert result["r"].status_code == 200
    assert result["r"].json()["meta_info"]["completion_tokens"] == 1900
