"""The emulated low-precision activations (MXFP8, NVFP4, four-over-six, FP8 blocks, FP8 per
token) capture into a CUDA graph and replay to the CPU's bytes: the engine runs them inside its
decode graphs, where a host table copied per call failed the capture on an H100 (issue 23).
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_lowprec_graph_capture_cuda.py`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from milepost.lowprec.linear import quantize_activation
from milepost.lowprec.quantize import quantize_fp8_per_token

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_PATHS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mxfp8": lambda x: quantize_activation(x, "mxfp8"),
    "nvfp4": lambda x: quantize_activation(x, "nvfp4"),
    "nvfp4 + four-over-six": lambda x: quantize_activation(x, "nvfp4", four_over_six=True),
    "fp8_block": lambda x: quantize_activation(x, "fp8_block"),
    "fp8 per token": lambda x: quantize_fp8_per_token(x)[0].view(torch.uint8),
}


@pytest.mark.parametrize("name", list(_PATHS))
def test_activation_quantizer_captures_and_replays_the_cpu_bits(name: str) -> None:
    fn = _PATHS[name]
    g = torch.Generator().manual_seed(0)
    host = torch.randn(8, 256, generator=g) * torch.logspace(-6, 6, 8)[:, None]
    host[2, 5] = float("nan")
    x = host.to("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as the engine does
        fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    x.copy_(host.flip(0))  # new input, same buffer: the replay must read it
    graph.replay()
    torch.cuda.synchronize()
    want = fn(host.flip(0))
    assert torch.equal(_bits(out.cpu()), _bits(want)), name


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes to compare: a float tensor's NaNs (a NaN block dequantizes to NaN) as one pattern,
    since the NaN a float product returns differs by device (x86 passes the operand through,
    CUDA returns a canonical one); the E4M3 codes themselves are compared as they are."""
    if t.dtype == torch.uint8:
        return t
    return torch.where(t.isnan(), -1.0, t).view(torch.int32)
