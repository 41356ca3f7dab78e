"""Bytes the engine holds for MoE experts at a real shape: bf16 vs FP8 blockwise vs packed INT4,
counted from the stores' own tensors (every parameter and buffer of the converted
StackedExperts: values and scales), not from a formula.

    python benchmarks/expert_bytes.py [--layers 2] [--experts 128 --hidden 2048 --inter 768 --model-layers 48]

Defaults: Qwen3-30B-A3B (128 experts of hidden 2048 and intermediate 768, 48 layers). Runs on
CPU (random bf16 weights; the byte counts do not depend on the values); `--layers` layers are
built and converted per format, and the total is scaled to `--model-layers`.
"""

from __future__ import annotations

import argparse
import time

import torch

from milepost.lowprec.engine_experts import _convert as to_fp8
from milepost.lowprec.experts_int4 import _pack as to_int4
from milepost.models.qwen3_moe import StackedExperts


def held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--model-layers", type=int, default=48)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    per: dict[str, list[int]] = {"bf16": [], "fp8_block": [], "int4": []}
    for _ in range(a.layers):
        for fmt, convert in (("bf16", None), ("fp8_block", to_fp8), ("int4", to_int4)):
            with torch.device("meta"):
                m = StackedExperts(a.experts, a.hidden, a.inter)
            m.w13 = torch.nn.Parameter(torch.randn(m.w13.shape, generator=g).bfloat16(), requires_grad=False)
            m.w2 = torch.nn.Parameter(torch.randn(m.w2.shape, generator=g).bfloat16(), requires_grad=False)
            t0 = time.perf_counter()
            if convert is not None:
                convert(m)
            per[fmt].append(held_bytes(m))
            print(f"  {fmt:9s} layer: {per[fmt][-1]:,} bytes ({time.perf_counter() - t0:.1f} s to convert)",
                  flush=True)
            del m
    bf16 = sum(per["bf16"]) / a.layers
    print(f"experts {a.experts} x (hidden {a.hidden}, intermediate {a.inter}); "
          f"per layer and x{a.model_layers} layers:")
    for fmt, counts in per.items():
        layer = sum(counts) / a.layers
        print(f"{fmt:9s} {layer / 2**20:9.1f} MiB/layer  {layer * a.model_layers / 2**30:7.2f} GiB  "
              f"{layer / bf16:.3f}x bf16")


if __name__ == "__main__":
    main()
