"""The engine's 16-bit projections at decode M by the stream-K GEMM (`--decode-gemm`, issue 27).

A decode step multiplies a few to a few hundred rows by every projection weight: the weight's
bytes are the whole cost, and cuBLAS's GEMMs at those shapes were measured latency-bound on the
H200 (benchmarks/RESULTS.md, decode-M GEMMs: 0.6-1.2 TB/s on the 0.6B shape).
kernels/stream_decode.py streams equal shares of a weight over one wave of persistent programs.
`--decode-gemm stream` runs it for every plain `nn.Linear` whose shape it takes, at every M up
to DECODE_M on CUDA under inference; `auto` times both GEMMs on the model's own weights at start
(every layer's weight of a shape in turn, from a CUDA graph, as a decode step reads them) and
uses the stream-K GEMM for a (shape, M bucket) only where it was faster; `cublas` (the default
until measured on a GPU) leaves the model as it is. Training forwards (grad on), CPU and larger
M always take F.linear. Values differ from cuBLAS's by the association of fp32 sums only.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
DECODE_M = 256
BUCKETS = (1, 8, 16, 32, 64, 128, 256)


def bucket(m: int) -> int:
    return next(b for b in BUCKETS if m <= b)


class StreamLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose decode-M inference forwards on CUDA
    run the stream-K GEMM for the M buckets in `stream_buckets`."""

    stream_buckets: frozenset[int] = frozenset()
    devices: tuple[str, ...] = ("cuda",)  # the CPU tests add "cpu" (Triton's interpreter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        if (0 < m <= DECODE_M and x.device.type in self.devices and not torch.is_grad_enabled()
                and bucket(m) in self.stream_buckets and x.dtype == self.weight.dtype):
            from milepost.kernels.stream_decode import stream_mm

            y = stream_mm(x.reshape(m, k), self.weight, x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.weight.shape[0])
        return F.linear(x, self.weight, self.bias)


def _fits(mod: nn.Module) -> bool:
    """A plain nn.Linear with 16-bit weights whose N and K the kernel's 64-wide tiles divide."""
    if type(mod) is not nn.Linear or mod.weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, k = mod.weight.shape
    return n % 64 == 0 and k % 64 == 0 and mod.weight.stride(1) == 1


def _graph_ms(fn, device: torch.device, reps: int = 10) -> float:
    """Milliseconds per replay of `fn` captured in a CUDA graph (warmed up eagerly first)."""
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps


def time_stream_buckets(mods: list[nn.Linear], device: torch.device) -> set[int]:
    """The M buckets where the stream-K GEMM over every weight in `mods` (one shape) took less
    time than F.linear, each timed from a CUDA graph; a bucket whose stream run fails stays cuBLAS."""
    from milepost.kernels.stream_decode import stream_mm

    n, k = mods[0].weight.shape
    faster = set()
    for b in BUCKETS:
        x = torch.randn(b, k, device=device, dtype=mods[0].weight.dtype)
        with torch.inference_mode():
            try:
                ours = _graph_ms(lambda: [stream_mm(x, m.weight, x.dtype) for m in mods], device)
            except Exception as e:  # noqa: BLE001 - this Triton/GPU cannot run it: cuBLAS then
                log.warning("stream-K GEMM [%d, %d] at M=%d not used: %s", n, k, b, str(e).splitlines()[0][:160])
                continue
            theirs = _graph_ms(lambda: [F.linear(x, m.weight) for m in mods], device)
        log.info("decode GEMM [%d, %d] x %d weights at M=%d: cuBLAS %.1f us, stream-K %.1f us a call",
                 n, k, len(mods), b, theirs * 1e3 / len(mods), ours * 1e3 / len(mods))
        if ours < theirs:
            faster.add(b)
    return faster


def applies(args) -> bool:
    """Whether an engine with these (resolved) settings converts its projections: `stream` always
    (its refused combinations never start); `auto` only for an unquantized model without LoRA
    adapters (they replace nn.Linear modules themselves) and without --true-on-policy."""
    if args.decode_gemm == "stream":
        return True
    return args.decode_gemm == "auto" and not (args.quantization or args.enable_lora or args.true_on_policy)


def use_stream_linears(model: nn.Module, mode: str, device: torch.device) -> dict[tuple[int, int], list[int]]:
    """Turn the model's plain 16-bit nn.Linear layers into StreamLinear (`mode` 'stream': every
    M bucket; 'auto': the buckets time_stream_buckets finds faster per weight shape). Returns
    {(N, K): buckets} for the shapes converted. Call before the decode graphs are captured."""
    if mode == "cublas" or device.type != "cuda":
        return {}
    from milepost.kernels.fp8_decode import _tickets

    _tickets(device)  # the kernel's tile counters, allocated now: not inside a graph's memory pool
    chosen = convert_linears(model, lambda mods: set(BUCKETS) if mode == "stream"
                             else time_stream_buckets(mods, device))
    log.info("--decode-gemm %s: stream-K GEMM for %s", mode,
             ", ".join(f"[{n}, {k}] at M buckets {b}" for (n, k), b in chosen.items()) or "no projection")
    return chosen


def convert_linears(model: nn.Module, choose) -> dict[tuple[int, int], list[int]]:
    """Group the plain 16-bit nn.Linear layers whose shape the kernel takes by weight shape; each
    group for which `choose(modules)` gives M buckets becomes StreamLinear for those buckets."""
    by_shape: dict[tuple[int, int], list[nn.Linear]] = defaultdict(list)
    for mod in model.modules():
        if _fits(mod):
            by_shape[tuple(mod.weight.shape)].append(mod)
    chosen = {}
    for shape, mods in by_shape.items():
        buckets = choose(mods)
        if not buckets:
            continue
        for mod in mods:
            mod.__class__ = StreamLinear
            mod.stream_buckets = frozenset(buckets)
        chosen[shape] = sorted(buckets)
    return chosen
