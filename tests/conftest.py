"""Settings every test process needs before any module imports them, and the start of the
session's one background build of the demo base model (`_demo_build_started`, below).

OpenMP threads wait passively (below). Without CUDA, Triton kernels run under Triton's interpreter, which reads TRITON_INTERPRET once,
when triton is first imported; whichever test module imports milepost's kernels first (an engine
test, a kernel test) must already see it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Before torch loads libgomp: OpenMP threads sleep instead of spinning at barriers, here and in every
# process a test starts (they inherit it); on shared cores spinning made steps 30x slower
# (milepost/launch/process.py, OPENMP_DEFAULTS).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's command runs `-n 2`), the workers share the cores: each test
# process computes with its share of them, not with every core (4 threads on 2 cores thrash).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(scope="session", autouse=True)
def _demo_build_started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """At each test process's first test: if any collected test trains on the demo base model
    (`demo_dir`, tests/e2e/conftest.py), start building it in the background, once for the whole
    session (xdist workers included), so the minutes it takes overlap other tests."""
    from milepost.testing.demo_build import SharedDemoBuild, session_root, uses_demo_dir

    if any(uses_demo_dir(item) for item in request.session.items):
        SharedDemoBuild(session_root(tmp_path_factory.getbasetemp())).start()


# Module run times (seconds, summed over the module's tests) from a measured run of the README's
# command: tests/module_seconds.json. Under xdist, modules run longest first, so a long module
# starts while the other worker still has short ones to take, instead of ending the run alone.
_MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first under pytest-xdist (a module's tests stay together and in order, so
    its module-scoped fixtures are set up once per worker); unlisted modules keep their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not _MODULE_SECONDS.exists():
        return
    seconds = json.loads(_MODULE_SECONDS.read_text())["modules"]
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::", 1)[0], 0.0), order[id(item)]))
