"""Where one thread's host time goes, from py-spy's raw samples: own and inclusive time per function.

    py-spy record --idle --threads -r 2000 -f raw -o host.txt -- python benchmarks/... ARGS
    python benchmarks/host_samples.py host.txt [--thread milepost-engine] [--within FUNC] [--top 40]

py-spy samples the process from outside (no tracing overhead, unlike cProfile, which doubled the
engine's Python costs in session 29's speculative-step profile), so the shares are those of a
normal run. `--idle` keeps samples where the thread waits (a device synchronize, a queue): those
are time the step spends too. Only stacks of threads whose name contains `--thread` count, and with `--within`
only those passing through that function (a script's timed part, not its set-up).
The device machine lacks py-spy: `gpu_wheels.sh` adds its wheel to `.whl/`, which puts it in
`/tmp/site/bin` there.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<where>[^()]*)\)$")


def frames(stack: str) -> list[str]:
    """`func (file:line)` frames -> `func (file)`, the line dropped so one function is one entry."""
    out = []
    for part in stack.split(";"):
        m = _FRAME.match(part)
        if m:
            where = m["where"].rsplit(":", 1)[0]
            where = re.sub(r"^.*/(milepost|torch|triton|site-packages)/", r"\1/", where)
            out.append(f"{m['func']} ({where})")
    return out


def summarize(lines: list[str], thread: str, within: str | None = None) -> tuple[int, Counter, Counter]:
    """(samples, own samples per function, inclusive samples per function) of matching threads."""
    total, own, incl = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        head, _, rest = stack.partition(";")
        if thread not in head:
            continue
        fs = frames(rest)
        if within is not None and not any(f.startswith(within + " (") for f in fs):
            continue
        n = int(count)
        total += n
        if fs:
            own[fs[-1]] += n
        for f in set(fs):
            incl[f] += n
    return total, own, incl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy record -f raw output")
    ap.add_argument("--thread", default="milepost-engine", help="count threads whose name has this")
    ap.add_argument("--within", default=None, help="only stacks through this function")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    with open(a.raw) as f:
        total, own, incl = summarize(f.readlines(), a.thread, a.within)
    if not total:
        raise SystemExit(f"no samples of a thread named like {a.thread!r} in {a.raw}")
    print(f"{total} samples of thread(s) {a.thread!r}")
    for title, table in (("own", own), ("inclusive", incl)):
        print(f"--- by {title} time (% of the thread's samples)")
        for func, n in table.most_common(a.top):
            print(f"  {100 * n / total:5.1f}%  {func}")


if __name__ == "__main__":
    main()
