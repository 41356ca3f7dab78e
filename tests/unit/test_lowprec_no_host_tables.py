"""The quantizers the engine's forward runs under CUDA graphs (lowprec/elements.py, quantize.py)
make no tensor from host data and move none to a device per call: a host-to-device copy fails
a graph capture ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"), which is
how MXFP8 and NVFP4 engines failed on an H100 (issue 23). A CPU cannot capture a graph, so the
test records the calls that would copy: torch.tensor / as_tensor (host data) and Tensor.to /
.cuda with a device. The table-free code paths give the old tables' bits exactly."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from milepost.kernels.fp8_rowwise import emulated_rowwise_linear
from milepost.lowprec import elements as el
from milepost.lowprec.linear import quantize_activation
from milepost.lowprec.quantize import dequantize, quantize, quantize_fp8_per_token
from milepost.lowprec.stochastic import round_e2m1_stochastic

torch.set_num_threads(1)


class _HostCopies(TorchFunctionMode):
    """Records every call that makes a tensor from host data or moves one to a device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        moves = name in ("to", "cuda") and (
            "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:]))
        if name in ("tensor", "as_tensor", "from_numpy", "pin_memory") or moves or name == "cuda":
            self.calls.append(name)
        return func(*args, **kwargs)


def _forward_paths() -> list[tuple[str, Callable[[], object]]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    x[1, 3] = float("nan")
    w8 = (torch.randn(32, 64, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    return [
        ("mxfp8 activation", lambda: quantize_activation(x, "mxfp8")),
        ("nvfp4 activation", lambda: quantize_activation(x, "nvfp4")),
        ("nvfp4 four-over-six", lambda: quantize_activation(x, "nvfp4", four_over_six=True)),
        ("fp8_block activation", lambda: quantize_activation(x, "fp8_block")),
        ("int4 weight", lambda: dequantize(quantize(x, "int4"))),
        ("nvfp4 weight", lambda: dequantize(quantize(x, "nvfp4"))),
        ("per-token fp8", lambda: quantize_fp8_per_token(x)),
        ("rowwise W8A8", lambda: emulated_rowwise_linear(x, w8, torch.rand(32, generator=g))),
        ("stochastic e2m1", lambda: round_e2m1_stochastic(x * 0.1, torch.rand(x.shape, generator=g))),
    ]


@pytest.mark.parametrize("i", range(9))
def test_forward_quantizers_copy_no_host_data(i: int) -> None:
    name, fn = _forward_paths()[i]
    with _HostCopies() as mode:
        fn()
    assert mode.calls == [], f"{name}: {mode.calls}"


def test_the_recorder_sees_the_old_table_pattern() -> None:
    table = torch.tensor([1.0, 2.0])
    with _HostCopies() as mode:
        torch.tensor(el.E2M1_VALUES, device="cpu")
        table.to(torch.device("cpu"))
    assert mode.calls == ["tensor", "to"]


def test_e8m0_decode_is_the_table() -> None:
    table = torch.tensor([math.ldexp(1.0, c - el.E8M0_BIAS) for c in range(255)] + [math.nan],
                         dtype=torch.float32)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = el.e8m0_decode(codes.reshape(16, 16)).reshape(-1)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), table.view(torch.int32))  # 2^-127 and NaN too


def test_e2m1_decode_and_codes_are_the_table() -> None:
    table = torch.tensor(el.E2M1_VALUES + tuple(-v for v in el.E2M1_VALUES))
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(el.e2m1_decode(codes).view(torch.int32), table.view(torch.int32))  # -0.0
    back = el.e2m1_codes(table)
    assert torch.equal(back, torch.where(codes == 8, 0, codes).to(torch.uint8))  # -0 -> +0
    odd = torch.tensor([float("nan"), -float("nan"), 0.25, 5.0, 7.0])  # not in the grid
    sorted_search = torch.searchsorted(torch.tensor(el.E2M1_VALUES), odd.abs().nan_to_num(0.0))
    sign = ((odd < 0) & (odd.abs() > 0)).to(torch.uint8) << 3
    assert torch.equal(el.e2m1_codes(odd), sorted_search.to(torch.uint8) | sign)


def test_stochastic_rounding_brackets_with_the_grid() -> None:
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor(el.E2M1_VALUES)
    v = torch.cat([torch.rand(20000, generator=g) * 12 - 6, grid, -grid])
    for u in (torch.zeros_like(v), torch.full_like(v, 1 - 2**-24)):  # always up / always down
        q = round_e2m1_stochastic(v, u).abs()
        i = torch.searchsorted(grid, v.abs(), right=True).clamp(1, 7) - 1
        lo, hi = grid[i], grid[(i + 1).clamp(max=7)]
        expect = torch.where(u < (v.abs() - lo) / torch.where(hi > lo, hi - lo, 1.0), hi, lo)
        assert torch.equal(q, expect)
