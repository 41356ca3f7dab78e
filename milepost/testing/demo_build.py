"""The demo base model of a pytest session: built once, in the background, for every worker.

`python -m milepost.demo.prepare` takes minutes. The first test process that sees a collected test
using it starts the build as a background process in the session's shared temporary folder (the
parent of every pytest-xdist worker's own), so the build overlaps tests that do not need it; a test
that does waits for it. `python -m milepost.testing.demo_build OUT PID` runs the build, records its
exit status in OUT.exit, and stops when process PID (the pytest session) is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["SharedDemoBuild", "session_root", "uses_demo_dir"]


def uses_demo_dir(item: object) -> bool:
    """Requests `demo_dir`, or is the `"demo"` case of a test that fetches it by
    `request.getfixturevalue` (tests/e2e/test_disk_delta_rl.py)."""
    callspec = getattr(item, "callspec", None)
    return "demo_dir" in getattr(item, "fixturenames", ()) or (
        callspec is not None and "demo" in callspec.params.values())


def session_root(basetemp: Path) -> Path:
    """The folder every process of this pytest session shares: under xdist each worker's basetemp
    is `<session basetemp>/popen-gwN`."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


def _session_pid() -> int:
    """The pytest process that outlives every test: the xdist controller (a worker's parent)."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


class SharedDemoBuild:
    """`SharedDemoBuild(root).start()` in any process (only the first call builds); `.wait(t)` in a
    test returns the prepared folder (base_model/, rl_prompts.jsonl, eval_prompts.jsonl)."""

    def __init__(self, root: Path, prepare_args: tuple[str, ...] = ("--seconds-budget", "0")) -> None:
        self.prepare_args = prepare_args  # after OUT_DIR on prepare's command line
        self.dir = Path(root) / "tiny-demo"
        self._claim = Path(root) / "tiny-demo.claim"  # mkdir is atomic: one process wins
        self._exit = Path(root) / "tiny-demo.exit"
        self._pid = Path(root) / "tiny-demo.pid"
        self.log = Path(root) / "tiny-demo.log"

    def start(self) -> bool:
        """Start the build unless a process of this session already did; True if this call did."""
        try:
            self._claim.mkdir(parents=True)
        except FileExistsError:
            return False
        from milepost.launch.process import openmp_defaults

        with open(self.log, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "milepost.testing.demo_build", str(self.dir), str(_session_pid()),
                 *self.prepare_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **openmp_defaults()})
        _write_atomic(self._pid, str(proc.pid))
        return True

    def wait(self, timeout_s: float, poll_s: float = 1.0) -> Path:
        """Block until the build ends; its folder, or RuntimeError/TimeoutError with the log's tail."""
        deadline = time.monotonic() + timeout_s
        while not self._exit.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the demo build did not finish in {timeout_s:.0f}s; {self._tail()}")
            if self._pid.exists() and not _alive(int(self._pid.read_text())) and not self._exit.exists():
                time.sleep(poll_s)  # it may have written its exit file just now
                if not self._exit.exists():
                    raise RuntimeError(f"the demo build process died without an exit status; {self._tail()}")
            time.sleep(poll_s)
        code = int(self._exit.read_text())
        if code != 0:
            raise RuntimeError(f"python -m milepost.demo.prepare exited {code}; {self._tail()}")
        return self.dir

    def _tail(self, n: int = 3000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"its log ({self.log}) ends:\n{text[-n:]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _watch(pid: int) -> None:
    """Exit this process when `pid` is gone: an interrupted session must not leave a build running."""
    while _alive(pid):
        time.sleep(2.0)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    """argv: OUT_DIR SESSION_PID [prepare's options]."""
    out_dir, session_pid, *options = argv if argv is not None else sys.argv[1:]
    threading.Thread(target=_watch, args=(int(session_pid),), daemon=True).start()
    from milepost.demo.prepare import main as prepare

    code = 1  # an exception propagates (its traceback goes to the log) after the status is written
    try:
        code = prepare([out_dir, *options])
    except SystemExit as e:  # argparse refusing an option
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        _write_atomic(Path(out_dir).parent / (Path(out_dir).name + ".exit"), str(code))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
