"""Peak memory of an engine start (issue 23): from a bf16 checkpoint, bf16 and each --quantization
format; from a quantized checkpoint (`--checkpoint fp8_block|int4`: the bf16 one converted by
`milepost convert`, FP8 blockwise or compressed-tensors W4A16), its store serving it as stored;
each quantized start both ways,
  layerwise    each layer loaded, fused and stored before the next (what `milepost serve` does);
  after-build  the whole model built in bf16 first, then stored (milepost/testing/whole_start.py:
               the path of a model handed in, and of every quantized start before
               lowprec/engine_load.py; of stored checkpoints and `fp8` before 4f7f782).
Each start runs in a process of its own: peak RSS (ru_maxrss, the process's high-water mark, which
also counts the checkpoint pages read through safetensors' mmap), its rise over the process before
the start, torch.cuda.max_memory_allocated on CUDA, and the bytes the served weights hold
(`engine_load.held_bytes`). Random weights of a bench shape (bench/models.py), resized with
--layers / --vocab / --experts, written as a bf16 Hugging Face directory first. On the CPU fp8_block
linears are emulated and keep their dequantized bf16 weights (only MoE experts are stored in
float8 there); int4 is packed on every device.

    PYTHONPATH=$PWD python benchmarks/engine_start_memory.py --shape qwen3-0.6b --layers 12 \
        --vocab 32768 --formats int4 --dir /tmp/startmem        [--device cuda]
    PYTHONPATH=$PWD python benchmarks/engine_start_memory.py --shape qwen3-30b-a3b --layers 12 \
        --experts 16 --vocab 32768 --checkpoint int4 --dir /tmp/startmem      [--profile 40]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

_MIB = 2**20


def _child(ckpt: Path, device: str, fmt: str, path: str) -> dict:
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine
    from milepost.lowprec.engine_load import held_bytes
    from milepost.testing.whole_start import quantize_after_build, served_args

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    args = ServerArgs(model_path=ckpt, device=device, dtype="bfloat16", max_total_tokens=256,
                      page_size=16, disable_cuda_graph=True,
                      quantization=None if fmt == "bf16" else fmt).resolved()
    if device == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    if path == "after-build":
        model = quantize_after_build(args, torch.bfloat16, torch.device(device))
        engine = build_engine(served_args(args), model=model)[0]
    else:
        engine = build_engine(args)[0]
    out = {"format": fmt, "path": path, "seconds": round(time.perf_counter() - t, 2)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out |= {"peak_rss_mib": round(peak / _MIB, 1), "rss_rise_mib": round((peak - before) / _MIB, 1),
            "weights_mib": round(held_bytes(engine.runner.model) / _MIB, 1),
            "kv_mib": round(engine.runner.kv.nbytes() / _MIB, 1)}
    if device == "cuda":
        out["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / _MIB, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--experts", type=int, default=None, help="MoE shapes: num_experts")
    p.add_argument("--formats", default=None, help="quantization formats, comma-separated (default: "
                   "int4,fp8_block from a bf16 checkpoint, the store of a quantized one)")
    p.add_argument("--checkpoint", default="bf16", choices=["bf16", "fp8_block", "int4"],
                   help="the checkpoint's layout: bf16, or the bf16 one converted (served as stored)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dir", type=Path, default=Path("/tmp/engine_start_memory"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint in --dir, and start from "
                   "the one there if it has this --checkpoint layout (repeat runs, other code trees)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print each start's N "
                   "most expensive calls by cumulative time (cProfile, in the start's own process)")
    p.add_argument("--child", nargs=2, metavar=("FORMAT", "PATH"), help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child:
        if a.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            out = prof.runcall(_child, a.dir / a.checkpoint, a.device, *a.child)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(a.profile)
        else:
            out = _child(a.dir / a.checkpoint, a.device, *a.child)
        print(json.dumps(out))
        return
    import transformers

    from milepost.bench.models import SHAPES
    from milepost.lowprec.contract import Contract
    from milepost.lowprec.convert import convert_checkpoint
    from milepost.testing.random_checkpoint import write_random_checkpoint

    config_cls, arch, kwargs = SHAPES[a.shape]
    sizes = {"num_hidden_layers": a.layers, "vocab_size": a.vocab, "num_experts": a.experts}
    config = getattr(transformers, config_cls)(**kwargs | {k: v for k, v in sizes.items() if v is not None})
    config.architectures = [arch]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.machine())
    ckpt = a.dir / a.checkpoint
    if not (a.keep and (ckpt / "config.json").exists()):
        shutil.rmtree(a.dir, ignore_errors=True)
        bf16 = write_random_checkpoint(a.dir / "bf16", config)
        if a.checkpoint != "bf16":
            convert_checkpoint(bf16, ckpt, Contract(a.checkpoint, a.checkpoint, (), False))
            shutil.rmtree(bf16)  # the bf16 files are not part of this start
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    print(json.dumps({"machine": cpu, "device": a.device, "threads": a.threads, "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": a.shape,
                      "layers": config.num_hidden_layers, "vocab": config.vocab_size,
                      "checkpoint": a.checkpoint, "checkpoint_mib": round(size / _MIB, 1)}))
    formats = a.formats or ("int4,fp8_block" if a.checkpoint == "bf16" else a.checkpoint)
    runs = [("bf16", "layerwise")] if a.checkpoint == "bf16" else []
    runs += [(f, path) for f in formats.split(",") for path in ("layerwise", "after-build")]
    for fmt, path in runs:
        cmd = [sys.executable, __file__, "--child", fmt, path, "--dir", str(a.dir),
               "--checkpoint", a.checkpoint, "--device", a.device, "--threads", str(a.threads),
               "--profile", str(a.profile)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if a.profile:
            print(f"--- {fmt} {path}: the start's {a.profile} most expensive calls ---\n{done.stderr}")
        lines = done.stdout.strip().splitlines()
        print(lines[-1] if done.returncode == 0 and lines else
              json.dumps({"format": fmt, "path": path, "error": done.stderr.strip().splitlines()[-1:]}))
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
