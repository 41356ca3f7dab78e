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

# The tests' own `milepost serve` processes (ServerProcess) fork from the preloaded server that
# `run_ranks` uses, on CPU: ~5 CPU-s of imports less per engine (milepost/testing/server_fork.py).
import milepost.testing.server_process  # noqa: E402

milepost.testing.server_process.FORK_FROM_PRELOADED = True


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


def pytest_configure(config: pytest.Config) -> None:
    """Under `--dist loadgroup`: the workers take the work units in the order of the collection
    (`pytest_collection_modifyitems`, below), each module one unit (`_ModuleGroups`). xdist's own
    order (units with the most tests first) sent the Ray module's six tests, which need the demo
    base model, to a worker at the session's start: its first test waited ~3 minutes for the build
    (CI: 183-220 s of a test that takes 36 s idle)."""
    if getattr(config.option, "dist", "no") == "loadgroup":  # the controller; workers run "no"
        config.option.loadscopereorder = False
    config.pluginmanager.register(_ModuleGroups(), "milepost-module-groups")


class _ModuleGroups:
    """Under `--dist loadgroup`, a test that names no `xdist_group` joins its module's (one unit
    for the tests that need the demo base model, one for the rest): a module's tests run on one
    worker, so its module-scoped fixtures (a reference training run, a server, a model) are set
    up once per session, not on both workers as they took its tests in turn (tests/e2e/
    test_train_loop.py's 2-rank reference run, ~20 s in CI, was built twice)."""

    @pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns group names into node id suffixes
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):  # what xdist sets on its workers
            return
        from milepost.testing.demo_build import uses_demo_dir

        for item in items:
            if not item.get_closest_marker("xdist_group"):
                part = "demo" if uses_demo_dir(item) else "rest"
                item.add_marker(pytest.mark.xdist_group(f"{item.nodeid.split('::', 1)[0]}:{part}"))


@pytest.hookimpl(trylast=True)  # after pytest-xdist has added the group names to the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist: tests that do not need the demo base model first, so the workers have
    work while it builds in the background (about 3 minutes; started by `_demo_build_started`)
    instead of waiting on it from their first test; within each part, longest modules first (a
    module's tests stay together and in order, and under `--dist loadgroup` on one worker, so its
    module-scoped fixtures are set up once); unlisted modules keep their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _refuse_ignored_xdist_groups(config, items)
    if not _MODULE_SECONDS.exists():
        return
    from milepost.testing.demo_build import uses_demo_dir

    seconds = json.loads(_MODULE_SECONDS.read_text())["modules"]
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (uses_demo_dir(item), -seconds.get(item.nodeid.split("::", 1)[0], 0.0),
                                 order[id(item)]))


def _refuse_ignored_xdist_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--dist loadgroup marks a grouped test by suffixing its node id with "@group"; pytest 9.2 with
    pytest-xdist 3.8 silently did not, so tests sharing one Ray cluster or one two-rank run started
    it twice, on both workers at once, and missed their limits on a busy machine."""
    if not getattr(config.option, "loadgroup", False):  # what xdist sets on its workers
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            raise pytest.UsageError(
                f"--dist loadgroup did not group {item.nodeid}: this pytest-xdist does not work with "
                f"pytest {pytest.__version__}; install the versions in pyproject.toml's test extra")
