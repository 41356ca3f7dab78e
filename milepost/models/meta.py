"""`on_meta()`: build modules on the meta device without running their random init.

Parameter init on meta tensors allocates nothing but still dispatches through torch's Python
reference kernels, whose first use imports dynamo (~1.5 s of CPU per process). Every engine and
trainer builds a model on meta at start (config checks, then the real load), so inside the block
in-place init calls on meta tensors return at once: meta parameters hold no values anyway. A
torch function mode is per thread, so other threads' init calls are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# torch.nn.init's functions and the Tensor methods they end in
_INIT_CALLS = frozenset((
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_", "fill_", "zero_", "random_", "exponential_", "bernoulli_",
))


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_CALLS:
            # torch.nn.init passes its tensor by keyword, Tensor methods as self
            target = kwargs.get("tensor", args[0] if args else None)
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """`with torch.device("meta")` whose modules skip their parameter init."""
    with torch.device("meta"), _SkipMetaInit():
        yield
