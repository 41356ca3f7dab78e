"""Run a session server on a loopback port in a background thread (tests, benchmarks, and the
rank-0 process of `milepost train` when agentic rollout is on).

Start-up refuses a family whose template fails the append-only check on this tokenizer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any, Self

import httpx
import uvicorn

from milepost.auth import protect, warn_if_exposed
from milepost.http_tls import tls_context
from milepost.launch.process import free_port
from milepost.rollout.client import EngineClient
from milepost.session.checks import require_append_only
from milepost.session.families import get_family
from milepost.session.matchers import load_matcher
from milepost.session.render import Renderer
from milepost.session.server import build_app
from milepost.session.service import SessionService, SessionSettings

log = logging.getLogger(__name__)


def make_renderer_unchecked(tokenizer_path: str | Path | Any, family: str) -> Renderer:
    """Renderer for the tokenizer at `tokenizer_path` (or a tokenizer object)."""
    if isinstance(tokenizer_path, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    else:
        tokenizer = tokenizer_path
    return Renderer(tokenizer, get_family(family))


def make_renderer(tokenizer_path: str | Path | Any, family: str) -> Renderer:
    """Renderer for the tokenizer at `tokenizer_path` (or a tokenizer object), checked."""
    renderer = make_renderer_unchecked(tokenizer_path, family)
    require_append_only(renderer)
    return renderer


class SessionServerThread:
    """`with SessionServerThread(tokenizer_dir, engine_url, family="qwen3") as srv: srv.url`."""

    def __init__(self, tokenizer: str | Path | Any, engine_url: str, *, family: str,
                 matcher: str = "strict", settings: SessionSettings | None = None,
                 host: str = "127.0.0.1", port: int | None = None,
                 engine_timeout_s: float = 600.0,
                 engine_transport: httpx.AsyncBaseTransport | None = None,
                 api_key: str | None = None, lora_path: str | None = None) -> None:
        self.api_key = api_key
        self.lora_path = lora_path  # LoRA RL: every engine request names the trained adapter
        warn_if_exposed(host, api_key, "the session server", log)
        self.renderer = make_renderer(tokenizer, family)
        self.matcher = load_matcher(matcher)
        self.settings = settings or SessionSettings()
        self.engine_url = engine_url
        self.engine_timeout_s = engine_timeout_s
        self.engine_transport = engine_transport  # e.g. one that records the engine's answers
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.service: SessionService | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        config = uvicorn.Config(self._app_factory, host=host, port=self.port, log_level="warning",
                                factory=True, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"session-server:{self.port}",
                                        daemon=True)
        self._thread.start()
        self._wait_healthy()

    def _app_factory(self) -> Any:
        # The engine client belongs to the server's event loop, so it is made here.
        client = EngineClient(self.engine_url, self.engine_timeout_s, generate_retries=0,
                              transport=self.engine_transport, require_routing_key=True,
                              lora_path=self.lora_path)
        self.service = SessionService(self.renderer, client, self.matcher, self.settings)
        app = build_app(self.service)
        protect(app, self.api_key)  # milepost/auth.py: agents send it as their api_key
        return app

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve())
        except BaseException as e:  # noqa: BLE001 - surfaced by _wait_healthy
            self._error = e

    def _wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"session server on port {self.port} failed to start: "
                                   f"{self._error}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, verify=tls_context()).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"session server on port {self.port} not healthy after {timeout_s} s")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
