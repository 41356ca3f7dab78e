"""`on_meta()` builds modules without running their parameter init (so without importing dynamo,
which torch's meta-tensor init paths pull in), and leaves init outside the block, and in other
threads, untouched."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch
from torch import nn

from milepost.models.meta import on_meta


def test_an_engine_start_builds_its_model_without_importing_dynamo(tmp_path) -> None:
    from milepost.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=1)
    code = ("import sys; from milepost.models.registry import load_model; "
            f"load_model({str(tmp_path / 'm')!r}, __import__('torch').float32, 'cpu'); "
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # nor sympy (~0.5 s of CPU): storage is allocated without torch's meta reference kernels
    assert out.stdout.strip() == "False False", out.stderr[-2000:]


def test_modules_built_on_meta_and_real_init_still_runs() -> None:
    with on_meta():
        emb, lin = nn.Embedding(10, 4), nn.Linear(4, 3)
    assert emb.weight.is_meta and lin.weight.is_meta and lin.bias.shape == (3,)
    x = torch.zeros(64)
    nn.init.normal_(x)
    assert x.abs().sum() > 0  # outside the block, init works


def test_another_threads_init_is_untouched_while_one_builds_on_meta() -> None:
    inside, done = threading.Event(), threading.Event()
    seen: list[float] = []

    def other() -> None:
        inside.wait(30)
        x = torch.zeros(64)
        nn.init.uniform_(x, 1.0, 2.0)
        seen.append(float(x.min()))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with on_meta():
        inside.set()
        assert done.wait(30)
        nn.Linear(4, 4)
    t.join()
    assert seen and seen[0] >= 1.0
