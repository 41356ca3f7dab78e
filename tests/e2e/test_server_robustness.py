"""Requests that once broke or stalled an engine (issue 19): each is refused or contained, and the
engine then answers a good request correctly, with its KV back where it started."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from milepost.testing.server_process import ServerProcess

GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6,
                                                    "ignore_eos": True}}


@pytest.fixture(scope="module")
def srv(qwen3_dir: Path) -> ServerProcess:
    with ServerProcess(qwen3_dir, "--max-total-tokens", "8192", "--max-request-batch", "3000",
                       "--max-request-body-mb", "1") as s:
        yield s


@pytest.fixture(scope="module")
def reference(srv: ServerProcess) -> list[int]:
    return _good(srv)


def _good(srv: ServerProcess) -> list[int]:
    r = httpx.post(f"{srv.url}/generate", json=GOOD, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _wait_idle(srv: ServerProcess, limit_s: float) -> dict:
    deadline = time.monotonic() + limit_s
    while True:
        load = httpx.get(f"{srv.url}/v1/loads", timeout=10).json()["loads"][0]
        if load["num_total_reqs"] == 0 and load["num_used_tokens"] == 0:
            return load
        assert time.monotonic() < deadline, f"still busy after {limit_s} s: {load}"
        time.sleep(0.2)


def test_abandoned_batch_is_aborted(srv: ServerProcess, reference: list[int]) -> None:
    """2,000 prompts whose client gives up after 2 s: the engine drops them, it does not run
    them to the end (2 million tokens: tens of minutes on this CPU) while new requests wait."""
    body = {"input_ids": [[1 + i % 400, 2, 3] for i in range(2000)],
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{srv.url}/generate", json=body, timeout=2)
    t0 = time.monotonic()
    _wait_idle(srv, limit_s=60)
    drained = time.monotonic() - t0
    assert _good(srv) == reference
    assert drained < 60


def test_long_text_is_refused_before_tokenizing(srv: ServerProcess, reference: list[int]) -> None:
    text = "word " * 2_000_000  # 10 MB: over the body limit of this server, and over the char cap
    r = httpx.post(f"{srv.url}/generate", json={"text": text}, timeout=60)
    assert r.status_code == 413 and "--max-request-body-mb" in r.json()["error"]["message"]
    text = "word " * 100_000  # 500 kB: inside the body limit, beyond 2048 tokens * 32 characters
    t0 = time.monotonic()
    r = httpx.post(f"{srv.url}/generate", json={"text": text}, timeout=60)
    assert r.status_code == 400, r.text
    assert "characters" in r.json()["error"]["message"] and "text" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    assert _good(srv) == reference


def test_batch_over_the_limit_is_413(srv: ServerProcess, reference: list[int]) -> None:
    r = httpx.post(f"{srv.url}/generate", timeout=30, json={
        "input_ids": [[1]] * 1001, "sampling_params": {"n": 3, "max_new_tokens": 1}})
    assert r.status_code == 413
    assert "3003 sequences" in r.json()["error"]["message"]
    assert "--max-request-batch" in r.json()["error"]["message"]
    _wait_idle(srv, limit_s=30)
    assert _good(srv) == reference


def test_surrogate_weight_version_leaves_the_server_serving(srv: ServerProcess,
                                                            reference: list[int]) -> None:
    r = httpx.post(f"{srv.url}/update_weight_version", content=b'{"new_version": "\\ud800"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "new_version" in r.json()["error"]["message"]
    for path in ("/get_weight_version", "/get_model_info", "/get_server_info"):
        assert httpx.get(f"{srv.url}{path}", timeout=10).status_code == 200, path
    assert httpx.get(f"{srv.url}/get_weight_version", timeout=10).json()["weight_version"] == "default"
    assert _good(srv) == reference


def test_surrogate_pair_is_fine(srv: ServerProcess) -> None:
    r = httpx.post(f"{srv.url}/generate", timeout=30, content=b'{"text": "smile \\ud83d\\ude00", '
                   b'"sampling_params": {"max_new_tokens": 1}}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_top_p_that_underflows_samples_the_top_token(srv: ServerProcess,
                                                     reference: list[int]) -> None:
    body = {**GOOD, "sampling_params": {**GOOD["sampling_params"], "temperature": 1.0,
                                        "top_p": 1e-300}}
    r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == reference  # only the most likely token is ever kept
    assert set(reference) != {0}


@pytest.mark.parametrize("make", [
    lambda: {"text": "hi", "sampling_params": {"temperature": float("inf")}},
], ids=["temperature-inf"])
def test_non_finite_numbers_are_400(srv: ServerProcess, make: Callable[[], dict]) -> None:
    import json

    raw = json.dumps(make()).encode()  # Python writes Infinity, as a careless client would
    r = httpx.post(f"{srv.url}/generate", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
