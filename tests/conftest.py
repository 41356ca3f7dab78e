"""Settings every test process needs before any module imports them.

Without CUDA, Triton kernels run under Triton's interpreter, which reads TRITON_INTERPRET once,
when triton is first imported; whichever test module imports milepost's kernels first (an engine
test, a kernel test) must already see it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
