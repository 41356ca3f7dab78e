"""Rank 0 waits, before the first rollout, until every engine of the run answers /health."""

from __future__ import annotations

import time

import httpx

from milepost.driver.preflight import RunError
from milepost.http_tls import tls_context


def wait_for_engines(urls: list[str], timeout_s: float = 900.0) -> None:
    """Block until every engine answers /health: the launcher may start the trainer ranks while
    engines still load. (The launcher stops the run if one fails to start; this bound is a
    backstop for launchers that do not.)"""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5, verify=tls_context()).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RunError(f"engine {url} did not answer /health within {timeout_s:.0f} s")
            time.sleep(0.2)
