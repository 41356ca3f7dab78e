"""Weight bytes an engine holds per format, counted (CPU, no GPU needed): for each shape, the
native model in bf16 with its projections fused, then `store_quantized` in each format, and the
bytes of every covered projection's parameters and buffers (values and scales) summed. fp8_block
on the CPU is emulated (its weight holds the dequantized bf16 values), so its native layout
(float8 values + float32 128 x 128 tile scales, what a Hopper GPU stores) is counted from the
quantizer's output; INT4 is packed on every device, so its count is what the engine holds here.

    PYTHONPATH=$PWD python benchmarks/lowprec_bytes.py --shapes tiny,qwen3-0.6b
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from milepost.bench import models as bench_models
from milepost.lowprec.contract import Contract
from milepost.lowprec.engine_store import QuantizedLinear, store_quantized


def projection_bytes(shape: str, fmt: str) -> dict:
    model, _ = bench_models.native_model(None, shape, torch.bfloat16, torch.device("cpu"), 0)
    model.fuse_projections()
    if fmt != "bf16":
        store_quantized(model, Contract(fmt, fmt))
    held = native = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module is getattr(model, "lm_head", None):
            continue
        if fmt != "bf16" and not isinstance(module, QuantizedLinear):
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        held += sum(t.numel() * t.element_size() for t in tensors)
        if fmt == "fp8_block" and not module.native:  # the Hopper layout of the same parts
            native += sum(q.values.numel() * q.values.element_size() + q.scales.numel() * 4
                          for _, _, q in module.qparts)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    out = {"shape": shape, "format": fmt, "projection_bytes_held": held, "model_bytes_held": total}
    if native:
        out["projection_bytes_native_layout"] = native
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="tiny,qwen3-0.6b")
    p.add_argument("--formats", default="bf16,fp8_block,int4")
    a = p.parse_args()
    torch.set_num_threads(2)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.machine())
    print(json.dumps({"machine": cpu,
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                        time.gmtime())}))
    for shape in a.shapes.split(","):
        for fmt in a.formats.split(","):
            t = time.time()
            row = projection_bytes(shape, fmt)
            row["seconds"] = round(time.time() - t, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
