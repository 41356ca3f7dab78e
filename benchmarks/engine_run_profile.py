"""Where a whole engine run's GPU time goes: benchmark (a)'s fixed workload under torch.profiler.

Unlike `engine_gpu_profile.py` (one graph replay in isolation) this profiles the engine as
`milepost bench engine` runs it (scheduler thread, overlap, sampler, CUDA graphs), then reports
from the kernel trace: the run's GPU-busy time against its wall span (the idle part is host work
the GPU waited for), and the kernels by total time, grouped into families.

Usage: python benchmarks/engine_run_profile.py [--shape qwen3-0.6b] [--requests 256]
       [--prompt 128] [--output 256] [--quantization fp8_block] [--kv-cache-dtype fp8_e4m3]
       [--trace-out FILE] [--temperature 0 --speculative-ngram]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from milepost.bench import models as bench_models
from milepost.bench import workloads
from milepost.bench.engine_side import EngineBench
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine

FAMILIES = [  # first match wins; names as CUDA reports them
    ("decode attention", r"_decode_split_kernel|_decode_merge_kernel"),
    ("prefill attention", r"_prefill_kernel|flash|fmha"),
    ("sampler", r"_partial|_merge\b|fused_sample|argmax|exponential|log_softmax"),
    ("GEMM (cuBLAS/CUTLASS)", r"gemm|nvjet|sm90_|sm80_|cutlass|xmma|splitK"),
    ("FP8/INT4 GEMM (Triton)", r"fp8|int4|_scaled|w4a16|_mm_"),
    ("MoE", r"moe|expert|_route|topk"),
    ("norm / rope / store / act", r"rms|norm|rope|rotary|_store_kv|silu|act|residual"),
    ("copies / fills", r"copy|Memcpy|Memset|fill|cat|index"),
]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.IGNORECASE):
            return fam
    return "other"


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals (kernels of several streams overlap)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


KINDS = ("kernel", "gpu_memcpy", "gpu_memset", "cpu_op")  # cpu_op: a --device cpu smoke run


def analyze(trace: dict, top: int) -> dict:
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in KINDS]
    if not kernels:
        raise RuntimeError("the trace has no kernel events (CUPTI unavailable?)")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    t0, t1 = min(s for s, _ in spans), max(e for _, e in spans)
    busy = busy_union(spans)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(float(e["dur"]))
    by_family: dict[str, float] = defaultdict(float)
    for name, durs in by_name.items():
        by_family[family(name)] += sum(durs)
    rows = sorted(((sum(d), len(d), n) for n, d in by_name.items()), reverse=True)[:top]
    return {"wall_us": t1 - t0, "busy_us": busy, "kernel_sum_us": sum(e["dur"] for e in kernels),
            "families_us": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n[:110], "total_us": t, "count": c, "mean_us": t / c} for t, c, n in rows]}


def report(title: str, r: dict, seconds: float, tokens: int) -> None:
    print(f"=== {title}: {tokens} tokens in {seconds:.3f} s under the profiler "
          f"({tokens / seconds:,.0f} tok/s)")
    print(f"kernel span {r['wall_us'] / 1e3:.1f} ms, GPU busy {r['busy_us'] / 1e3:.1f} ms "
          f"({100 * r['busy_us'] / r['wall_us']:.1f}%), idle {(r['wall_us'] - r['busy_us']) / 1e3:.1f} ms")
    for fam, us in r["families_us"].items():
        print(f"  {fam:28s} {us / 1e3:9.2f} ms  {100 * us / r['kernel_sum_us']:5.1f}%")
    print("top kernels: total ms, count, mean us, name")
    for k in r["top"]:
        print(f"  {k['total_us'] / 1e3:8.2f} {k['count']:7d} {k['mean_us']:8.1f}  {k['name']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8_e4m3: the FP8 KV pool")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--trace-out", default=None, help="also keep the chrome trace here")
    ap.add_argument("--device", default="cuda", help="cpu profiles operators (a smoke run)")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy (random weights loop)")
    ap.add_argument("--speculative-ngram", action="store_true",
                    help="NGRAM speculation (request scope, measured rest off: every step "
                         "speculates where it can), to split a speculative step's GPU and idle time")
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    native, config_dir = bench_models.native_model(None, a.shape, dtype, dev, 0)
    vocab = native.vocab_size
    sargs = ServerArgs(model_path=config_dir, device=dev.type, dtype=str(dtype)[6:],
                       max_running_requests=a.requests, random_seed=0,
                       quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
                       **(dict(speculative_algorithm="NGRAM", speculative_ngram_scope="request",
                               speculative_ngram_measured_rest=False)
                          if a.speculative_ngram else {})).resolved()
    engine, _, _ = build_engine(sargs, model=native)
    engine.start()
    try:
        bench = EngineBench(engine, a.temperature)
        bench.run(workloads.fixed(a.requests, a.prompt, a.output, vocab, 99))  # warm-up
        plain = bench.run(workloads.fixed(a.requests, a.prompt, a.output, vocab, 1))
        print(f"without the profiler: {plain.output_tokens / plain.seconds:,.0f} tok/s, decode step "
              f"{1e3 * plain.decode_seconds / max(1, plain.decode_steps):.3f} ms")
        with profile(activities=[ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            r = bench.run(workloads.fixed(a.requests, a.prompt, a.output, vocab, 0))
            seconds = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(a.trace_out or Path(tmp) / "trace.json")
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        spec = engine.speculator.stats if engine.speculator is not None else None
        if spec is not None:
            print(f"NGRAM: acceptance length {spec.accept_length:.2f}, {spec.verify_rows} verified "
                  f"request-steps, {engine.runner.verify_replays} verify steps in CUDA graphs")
        report(f"{a.shape} {a.quantization or 'bf16'} KV {a.kv_cache_dtype} {a.requests} x {a.prompt} -> {a.output}"
               + (" NGRAM" if spec is not None else ""),
               analyze(trace, a.top), seconds, r.output_tokens)
    finally:
        engine.close()
        del engine
        gc.collect()


if __name__ == "__main__":
    main()
