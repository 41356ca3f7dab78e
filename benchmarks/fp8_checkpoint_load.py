"""Serving an FP8 blockwise checkpoint vs quantizing the bf16 one on load (CPU, no GPU needed):
bytes on disk, conversion time, and the engine's start (weights read, stored in fp8_block) for
  bf16      the bf16 checkpoint, no quantization;
  on-load   the bf16 checkpoint with --quantization fp8_block (quantized at start);
  as-stored the FP8 checkpoint (`milepost convert hf-to-fp8`), served from its bytes.
Random weights of a shape (bench/models.py), written as a bf16 Hugging Face directory first.
Each start is timed three times (the later ones from the page cache); the engines are emulated on the CPU
(the weights are held dequantized in the model dtype), so the times are the load paths', not a
GPU's.

    PYTHONPATH=$PWD python benchmarks/fp8_checkpoint_load.py --shape qwen3-0.6b --dir /tmp/fp8load
        [--device cuda]   (the H200: the native store; CUDA graphs captured in each start)
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from milepost.bench import models as bench_models
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import convert_checkpoint


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _write_bf16(shape: str, dst: Path) -> None:
    model, config_dir = bench_models.native_model(None, shape, torch.bfloat16, torch.device("cpu"), 0)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {n: model.weight_view(n).contiguous() for n in model.hf_weight_names()
               if not (model.tie_word_embeddings and n == "lm_head.weight")}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy2(config_dir / "config.json", dst / "config.json")


def _start(path: Path, device: str, **kw: object) -> float:
    t = time.perf_counter()
    engine = build_engine(ServerArgs(model_path=path, device=device, dtype="bfloat16",
                                     max_total_tokens=64, page_size=16, **kw).resolved())[0]
    if device == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--dir", type=Path, default=Path("/tmp/fp8_checkpoint_load"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the native FP8 store (Hopper), float8 bytes copied as stored")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.machine())
    print(json.dumps({"machine": cpu, "threads": a.threads, "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))
    bf16, fp8 = a.dir / "bf16", a.dir / "fp8"
    shutil.rmtree(a.dir, ignore_errors=True)
    _write_bf16(a.shape, bf16)
    t = time.perf_counter()
    n = len(convert_checkpoint(bf16, fp8, Contract("fp8_block", "fp8_block")))
    convert_s = time.perf_counter() - t
    print(json.dumps({"shape": a.shape, "bf16_bytes": _bytes(bf16), "fp8_bytes": _bytes(fp8),
                      "fp8_tensors": n, "convert_s": round(convert_s, 2)}))
    for name, path, kw in (("bf16", bf16, {}), ("on-load", bf16, {"quantization": "fp8_block"}),
                           ("as-stored", fp8, {})):
        times = [round(_start(path, a.device, **kw), 2) for _ in range(3)]
        print(json.dumps({"shape": a.shape, "device": a.device, "start": name, "seconds": times}))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
