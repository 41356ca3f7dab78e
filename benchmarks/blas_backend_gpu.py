"""Decode-step projections under each of torch's GEMM back-ends: cuBLAS (the default), cuBLASLt
(`torch.backends.cuda.preferred_blas_library("cublaslt")`, whose heuristics include split-K and
stream-K kernels) and TunableOp (each shape timed over its candidates once, then replayed).

At M = 64-256 rows a 0.6B layer's four projections take ~46 us on an H100 (session 19:
0.6-1.2 TB/s, latency-bound, ~1.2 ms of a 3.4 ms decode step), far from their bytes' or flops'
bound; this measures whether another back-end's pick is faster where the engine runs them: a CUDA
graph of every layer's four projections (distinct weights a layer, as in the model) replayed,
median of `--reps` replays timed by CUDA events. Each back-end's outputs are compared with
cuBLAS's (largest |difference| over the largest |value|).

    PYTHONPATH=$PWD python benchmarks/blas_backend_gpu.py [--shapes qwen3-0.6b,qwen3-4b] [--rows 64,256]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.moe_sweep import graph_ms

SHAPES = {  # (layers, [(name, N, K)]): fused qkv, o, fused gate/up, down
    "qwen3-0.6b": (28, [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                        ("down", 1024, 3072)]),
    "qwen3-4b": (36, [("qkv", 6144, 2560), ("o", 2560, 4096), ("gate_up", 19456, 2560),
                      ("down", 2560, 9728)]),
}
BACKENDS = ("cublas", "cublaslt", "tunable")


def use_backend(name: str) -> None:
    torch.cuda.tunable.enable(name == "tunable")
    torch.cuda.tunable.tuning_enable(name == "tunable")
    torch.backends.cuda.preferred_blas_library("cublas" if name == "tunable" else name)


def timed_ms(fn: Callable[[], None], reps: int) -> float:
    """fn's CUDA graph replayed: median ms (moe_sweep.graph_ms), after two eager calls in which
    TunableOp tunes (never inside a capture)."""
    fn()
    fn()
    torch.cuda.tunable.tuning_enable(False)
    return graph_ms(fn, reps)


def run_shape(shape: str, rows: int, reps: int) -> None:
    layers, projs = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
                for _, n, k in projs] for _ in range(layers)]
    inputs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
              for _, _, k in projs]
    outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _, n, _ in projs]

    def step() -> None:
        for layer in weights:
            for x, w, o in zip(inputs, layer, outs):
                o.copy_(F.linear(x, w))

    def one(i: int) -> Callable[[], None]:
        def fn() -> None:
            for layer in weights:
                outs[i].copy_(F.linear(inputs[i], layer[i]))
        return fn

    base: list[torch.Tensor] | None = None
    first: dict[str, float] = {}
    for backend in BACKENDS:
        try:
            use_backend(backend)
            whole = timed_ms(step, reps) * 1e3 / layers
            parts = [timed_ms(one(i), reps) * 1e3 / layers for i in range(len(projs))]
        except RuntimeError as e:  # a back-end this build lacks
            print(f"{shape} M={rows} {backend}: failed: {str(e).splitlines()[0]}", flush=True)
            continue
        got = [o.clone() for o in outs]
        base = base or got
        diff = max(float((g.float() - b.float()).abs().max() / b.float().abs().max())
                   for g, b in zip(got, base))
        first.setdefault("cublas", whole)
        per = ", ".join(f"{name} {t:.1f}" for (name, _, _), t in zip(projs, parts))
        print(f"{shape} M={rows} {backend:9s}: {whole:6.1f} us a layer (x{first['cublas'] / whole:.3f} "
              f"of cublas; alone: {per}); max |diff| / max |cublas| {diff:.2e}", flush=True)
    use_backend("cublas")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b")
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("blas_backend_gpu.py needs a CUDA device")
    torch.cuda.tunable.set_filename("/tmp/milepost_tunableop_results.csv")  # not in the tree
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, default back-end "
          f"{torch.backends.cuda.preferred_blas_library()}", flush=True)
    for shape in a.shapes.split(","):
        for rows in (int(r) for r in a.rows.split(",")):
            run_shape(shape, rows, a.reps)


if __name__ == "__main__":
    main()
