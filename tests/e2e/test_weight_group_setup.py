"""`/init_weights_update_group` against a master that never answers: each setup runs in a thread
of its own with a bounded rendezvous, at most a few at once (429 beyond), the engine keeps
serving (generation, other weight endpoints) meanwhile, and SIGTERM still stops it promptly."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest

from milepost.engine.weight_routes import MAX_PENDING_SETUPS
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess, free_port

GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0,
                                                   "ignore_eos": True}}


def test_unreachable_masters_hold_no_shared_resource(tmp_path) -> None:
    model = make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False)
    srv = ServerProcess(model, "--max-total-tokens", "512", "--page-size", "4")
    try:
        nobody = free_port()  # nothing listens there: the rendezvous can only time out
        body = {"master_address": "127.0.0.1", "master_port": nobody, "rank_offset": 1,
                "world_size": 2, "backend": "gloo"}

        def init(i: int) -> int:
            try:
                return httpx.post(f"{srv.url}/init_weights_update_group", timeout=3,
                                  json={**body, "group_name": f"g{i}"}).status_code
            except httpx.TimeoutException:
                return 0  # still waiting on its master: the client gave up, as in the issue

        with concurrent.futures.ThreadPoolExecutor(MAX_PENDING_SETUPS) as pool:
            codes = list(pool.map(init, range(MAX_PENDING_SETUPS)))
        assert codes == [0] * MAX_PENDING_SETUPS, codes
        extra = httpx.post(f"{srv.url}/init_weights_update_group", timeout=30,
                           json={**body, "group_name": "one-more"})
        assert extra.status_code == 429 and "already waiting" in extra.json()["message"]
        t0 = time.monotonic()
        assert httpx.post(f"{srv.url}/generate", json=GEN, timeout=60).status_code == 200
        r = httpx.post(f"{srv.url}/weights_delta/prepare", timeout=60,
                       json={"root": str(tmp_path / "no-store"), "version": 0})
        assert r.status_code == 400  # another blocking weight endpoint still answers
        r = httpx.post(f"{srv.url}/destroy_weights_update_group", json={"group_name": "g0"},
                       timeout=60)
        assert r.status_code == 400  # a pending setup is not an open group
        assert time.monotonic() - t0 < 30
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            rc = srv.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            pytest.fail("milepost serve did not stop within 30 s of SIGTERM with setups pending")
        assert rc != -signal.SIGKILL and time.monotonic() - t0 < 30
    finally:
        srv.close()
