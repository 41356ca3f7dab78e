"""Shared fixtures of the end-to-end tests: tiny checkpoints and real `milepost serve` processes.

Checkpoints are built once per session. Servers that tests can share (default flags, small KV
pool) are started once per session per model, on first use; a test that needs its own flags
uses `start_server`, which closes what it started when the test ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess

# Enough for every shared-server test (the default CPU pool is 1 GiB per process).
SHARED_SERVER_FLAGS = ("--max-total-tokens", "32768")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def qwen3_server(qwen3_dir: Path) -> Iterator[ServerProcess]:
    """One shared Qwen3 server; tests must leave it unpaused, with no request in flight."""
    with ServerProcess(qwen3_dir, *SHARED_SERVER_FLAGS) as srv:
        yield srv


@pytest.fixture(scope="session")
def llama_server(llama_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(llama_dir, *SHARED_SERVER_FLAGS) as srv:
        yield srv


@pytest.fixture(scope="session")
def moe_server(moe_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(moe_dir, *SHARED_SERVER_FLAGS) as srv:
        yield srv


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    """`srv = start_server(model_dir, "--flag", "value", ...)`: a private server for this test."""
    started: list[ServerProcess] = []

    def start(model_dir: Path, *flags: str) -> ServerProcess:
        srv = ServerProcess(model_dir, *flags)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.close()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_dir: Path) -> object:
    """The tiny checkpoint's own tokenizer, to compute what the server should report."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)
