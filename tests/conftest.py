"""Settings every test process needs before any module imports them.

OpenMP threads wait passively (below). Without CUDA, Triton kernels run under Triton's interpreter, which reads TRITON_INTERPRET once,
when triton is first imported; whichever test module imports milepost's kernels first (an engine
test, a kernel test) must already see it.
"""

from __future__ import annotations

import os

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
