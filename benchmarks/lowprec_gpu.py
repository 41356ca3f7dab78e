"""Low precision on the GPU, one run: FP8 blockwise GEMMs vs bf16, engine decode tok/s with
`--quantization fp8_block` vs bf16 (same process, same workload, Qwen3 shapes with random
weights), and a train step of the quantized linears vs bf16.

    python benchmarks/lowprec_gpu.py --shapes qwen3-0.6b,qwen3-4b --json-out out.json

`--parts int4` times the packed INT4 W4A16 GEMM (milepost/kernels/int4_gemm.py) at decode M per
projection against bf16 cuBLAS and the FP8 decode GEMM (and at M = 4096 the dequantization +
cuBLAS path against bf16), from CUDA graphs over weight copies that
overflow L2 (benchmarks/fp8_gemm_sweep.py's timing), each config checked against the fp32
product of the dequantized weights first; `--modes bf16,int4 --parts engine` gives engine decode
tok/s and weight bytes of the two in one process. bf16, FP8 with each linear quantizing its own
input, and FP8 with the norms and SiLU * up making the FP8 activations, in one process (issue 23):

    PYTHONPATH=$PWD python benchmarks/lowprec_gpu.py --parts engine --shapes qwen3-0.6b,qwen3-4b \
        --modes bf16,fp8_block_unfused,fp8_block --json-out fp8_act.json

INT4:

    PYTHONPATH=$PWD python benchmarks/lowprec_gpu.py --parts int4,engine --modes bf16,fp8_block,int4 \
        --json-out int4.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.nn.functional as F

from milepost.bench import models as bench_models
from milepost.bench import workloads
from milepost.bench.engine_side import EngineBench
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine

def cuda_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gemms(shape: str) -> list[dict]:
    from milepost.kernels.fp8_gemm import block_backend, fp8_block_linear
    from milepost.lowprec.quantize import quantize

    cfg = bench_models.SHAPES[shape][2]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    rows = []
    dev = torch.device("cuda")
    print(f"fp8 blockwise backend: {block_backend(dev)}; at decode M: {block_backend(dev, 1)}",
          flush=True)
    for n, k, what in ((qkv, h, "qkv"), (2 * i, h, "gate_up"), (h, i, "down")):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q = quantize(w, "fp8_block")
        for m in (1, 16, 64, 256, 4096):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"shape": shape, "gemm": what, "M": m, "N": n, "K": k,
                   "bf16_ms": cuda_ms(lambda x=x, w=w: F.linear(x, w))}
            for backend in ("scaled_mm", "triton", "decode"):
                try:
                    row[f"fp8_{backend}_ms"] = cuda_ms(
                        lambda x=x, q=q, b=backend: fp8_block_linear(x, q.values, q.scales, b))
                except Exception as e:  # noqa: BLE001 - report, go on
                    row[f"fp8_{backend}_ms"] = f"failed: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


MODES = {"bf16": (None, "auto"), "fp8_block": ("fp8_block", "auto"),
         "fp8_block_unfused": ("fp8_block", "auto"),
         "fp8_block+fp8_kv": ("fp8_block", "fp8_e4m3"), "int4": ("int4", "auto"),
         "fp8_block_nostream": ("fp8_block", "auto"),
         "fp8_block+fp8_kv_summed": ("fp8_block", "fp8_e4m3"),
         "fp8_block+fp8_kv_norm_parts": ("fp8_block", "fp8_e4m3"),
         "fp8_block+fp8_kv_norm_parts4": ("fp8_block", "fp8_e4m3"),
         "fp8_block+fp8_kv_attn_quant": ("fp8_block", "fp8_e4m3"),
         "fp8_block+fp8_kv_pdl": ("fp8_block", "fp8_e4m3"),
         "fp8_block+fp8_kv_pdl_noprefetch": ("fp8_block", "fp8_e4m3")}
# fp8_block_unfused: each FP8 linear quantizes its own input (a launch per linear), as before the
# norms and SiLU * up made the FP8 activations themselves (QuantizedLinear.fuse_act_quant off).
UNFUSED_ACT = ("fp8_block_unfused",)
# fp8_block_nostream: the stream-K decode GEMM kept out of the probe (fp8_gemm.STREAM off; the
# probe runs again for it), so the decode M buckets choose among the GEMMs that were there before.
NO_STREAM = ("fp8_block_nostream",)
# fp8_block+fp8_kv_summed: every split decode GEMM's parts summed by their own launch, as before
# qkv_proj left them to the RoPE + store kernel (QuantizedLinear.leave_split_parts off);
# _norm_parts: o_proj's and down_proj's to the fused add + norm too (fp8_act.PARTS_TO_NORM), at
# 2 norm programs a row (fused_fp8_act.PARTS_GROUPS_PER_PROGRAM 16) or, _norm_parts4, the rule's 5.
SUMMED = ("fp8_block+fp8_kv_summed",)
NORM_PARTS = {"fp8_block+fp8_kv_norm_parts": 16, "fp8_block+fp8_kv_norm_parts4": None}
# _attn_quant: o_proj's input quantized by the decode attention kernel (no quantize launch;
# TritonPagedAttention.quantize_out).
ATTN_QUANT = ("fp8_block+fp8_kv_attn_quant",)
# _pdl: programmatic dependent launch through the decode step (fp8_quant.PDL: the activation
# kernels trigger, every decode GEMM launches early and prefetches its weight rows into L2).
PDL = ("fp8_block+fp8_kv_pdl", "fp8_block+fp8_kv_pdl_noprefetch")  # _noprefetch: the GEMMs
# launched early without asking L2 for their weights first (fp8_decode.PDL_PREFETCH off)


def int4_gemms(shape: str, ms: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """Per projection of `shape` and decode M: us per call of bf16 F.linear, the FP8 decode GEMM
    (its table config) and the W4A16 kernel (w4_rule's config, then a small grid), each INT4
    config first checked against the fp32 product of the dequantized weights (bf16 output)."""
    import math

    from fp8_gemm_sweep import L2_BYTES, LINEARS, graph_us

    from milepost.kernels import int4_gemm as ig
    from milepost.kernels.fp8_gemm import fp8_block_linear
    from milepost.lowprec.quantize import quantize

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"int4 W4A16 kernel probe: {ig.kernel_ok(dev)}", flush=True)
    rows = []
    ref = torch.empty(0)

    def timed(fn, count: int, check: bool) -> float | str:
        """us per call of fn(copy) from a CUDA graph over `count` copies; checked first against
        `ref` (the case being timed: the fp32 product of the dequantized weights)."""
        try:
            if check:
                err = (fn(0).float() - ref).abs().max().item()
                if not err <= 1e-2 * ref.abs().max().item():
                    return f"wrong (max diff {err:.3g})"
            return graph_us([lambda i=i: fn(i) for i in range(count)])[0]
        except Exception as e:  # noqa: BLE001 - report, go on
            return f"failed: {str(e).splitlines()[0][:100]}"

    for name, (n, k) in LINEARS[shape].items():
        w = torch.randn(n, k, device=dev) * 0.02
        q4, q8 = quantize(w, "int4"), quantize(w, "fp8_block")
        deq = ig.dequantize_int4(q4.values, q4.scales, k, torch.bfloat16).float()
        copies = max(2, min(64, math.ceil(L2_BYTES / (n * k // 2))))  # the int4 bytes overflow L2
        wb = [w.to(torch.bfloat16) for _ in range(min(copies, 32))]
        p4 = [(q4.values.clone(), q4.scales.clone()) for _ in range(copies)]
        p8 = [(q8.values.clone(), q8.scales.clone()) for _ in range(min(copies, 32))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ deq.t()
            row = {"shape": shape, "gemm": name, "M": m, "N": n, "K": k, "int4_copies": copies}
            row["bf16_us"] = timed(lambda i: F.linear(x, wb[i]), len(wb), False)
            row["fp8_decode_us"] = timed(
                lambda i: fp8_block_linear(x, p8[i][0], p8[i][1], "decode"), len(p8), False)
            rule = ig.w4_rule(m, n, k, sms)
            row["int4_rule"] = list(rule)
            row["int4_rule_us"] = timed(lambda i: ig.w4a16_mm(x, *p4[i], k, rule), copies, True)
            grid = {}
            bm = rule.block_m
            for bn in (32, 64, 128):
                for split in sorted({1, 2, 4, 8, rule.split}):
                    if split > math.ceil(k / 128):
                        continue
                    for stages in (3, 4):
                        cfg = ig.W4Config(bm, bn, split, 4 if bm * bn < 64 * 128 else 8, stages)
                        grid[str(tuple(cfg))] = timed(
                            lambda i, c=cfg: ig.w4a16_mm(x, *p4[i], k, c), copies, True)
            timed_ok = {c: t for c, t in grid.items() if isinstance(t, float)}
            best = min(timed_ok, key=timed_ok.get) if timed_ok else None
            row.update(int4_grid=grid, int4_best=best, int4_best_us=timed_ok.get(best))
            rows.append(row)
            print(json.dumps({k2: v for k2, v in row.items() if k2 != "int4_grid"}), flush=True)
        # Prefill M: the Triton dequantization into a temporary, then cuBLAS, against bf16 cuBLAS.
        x = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ deq.t()
        row = {"shape": shape, "gemm": name, "M": 4096, "N": n, "K": k,
               "bf16_us": timed(lambda i: F.linear(x, wb[i]), min(len(wb), 4), False),
               "int4_dequant_cublas_us": timed(lambda i: ig.int4_linear(x, *p4[i], k), min(copies, 4), True)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del wb, p4, p8
        torch.cuda.empty_cache()
    return rows


def engine_decode(shape: str, requests: int, prompt: int, output: int,
                  device: str = "cuda", modes: tuple[str, ...] = tuple(MODES)) -> dict:
    """Decode tok/s of bf16, fp8_block weights (the FP8 activations made by the norms and
    SiLU * up, and, fp8_block_unfused, quantized by each linear's own launch), and fp8_block
    weights + an FP8 KV pool, one engine at a time in this process (each closed and its pool
    freed before the next starts); the pool is sized by --mem-fraction-static, so
    kv_pool_tokens shows what fits."""
    from milepost.kernels import fp8_decode, fp8_gemm, fp8_quant, fused_fp8_act
    from milepost.lowprec import fp8_act
    from milepost.lowprec.engine_store import QuantizedLinear
    from milepost.models.triton_attention import TritonPagedAttention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = {"shape": shape, "requests": requests, "prompt": prompt, "output": output}
    for mode in modes:  # a fresh model (same seed) each: fp8 converts it in place
        quant, kv = MODES[mode]
        # read when the decode graphs are captured (engine start) and by every eager forward
        QuantizedLinear.fuse_act_quant = mode not in UNFUSED_ACT
        QuantizedLinear.leave_split_parts = mode not in SUMMED
        fp8_act.PARTS_TO_NORM = mode in NORM_PARTS
        TritonPagedAttention.quantize_out = mode in ATTN_QUANT
        fp8_quant.PDL = True if mode in PDL else None
        fp8_decode.PDL_PREFETCH = not mode.endswith("_noprefetch")
        fused_fp8_act.PARTS_GROUPS_PER_PROGRAM = NORM_PARTS.get(mode, 16)
        if device == "cuda":
            fp8_gemm.STREAM = mode not in NO_STREAM
            fp8_gemm._BACKEND.clear()  # probe again with or without the stream-K kernel
            fp8_gemm._SMALL.clear()
        native, config_dir = bench_models.native_model(None, shape, dtype, torch.device(device), 0)
        vocab = native.vocab_size
        sargs = ServerArgs(model_path=config_dir, device=device, dtype=str(dtype)[6:],
                           max_running_requests=requests, random_seed=0, quantization=quant,
                           kv_cache_dtype=kv, mem_fraction_static=0.85).resolved()
        engine, _, _ = build_engine(sargs, model=native)
        engine.start()
        try:
            bench = EngineBench(engine, 1.0)
            bench.run(workloads.fixed(requests, prompt, output, vocab, 99))  # warm-up
            r = bench.run(workloads.fixed(requests, prompt, output, vocab, 0))
            weights = sum(p.numel() * p.element_size() for p in native.parameters())
            weights += sum(b.numel() * b.element_size() for b in native.buffers())
            out[mode] = {"tok_s": r.output_tokens / r.seconds,
                         "decode_tok_s": (r.output_tokens - requests) / r.decode_seconds,
                         "weight_bytes": weights,
                         "kv_pool_tokens": engine.cfg.num_blocks * engine.cfg.block_size}
            if quant and device == "cuda":  # the GEMM each decode M bucket got (probe + timing)
                out[mode]["fp8_gemm_by_m"] = dict(fp8_gemm._SMALL.get(torch.cuda.current_device(), {}))
        finally:
            engine.close()
            QuantizedLinear.fuse_act_quant = True
            QuantizedLinear.leave_split_parts = True
            fp8_act.PARTS_TO_NORM = False
            TritonPagedAttention.quantize_out = False
            fp8_quant.PDL = None
            fp8_decode.PDL_PREFETCH = True
            fused_fp8_act.PARTS_GROUPS_PER_PROGRAM = 16
            if device == "cuda":
                fp8_gemm.STREAM = True
        # The engine and everything that refers to it go before the next one sizes its pool.
        del engine, bench, native
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(out), flush=True)
    # decode tok/s ratios: every mode against bf16, and the A/B pairs (name: numerator, denominator)
    pairs = {f"{m}_over_bf16_decode": (m, "bf16") for m in MODES if m != "bf16"}
    pairs.update({
        "fp8_stream_over_nostream_decode": ("fp8_block", "fp8_block_nostream"),
        "attn_quant_over_plain_decode": ("fp8_block+fp8_kv_attn_quant", "fp8_block+fp8_kv"),
        "pdl_over_plain_decode": ("fp8_block+fp8_kv_pdl", "fp8_block+fp8_kv"),
        "pdl_noprefetch_over_plain_decode": ("fp8_block+fp8_kv_pdl_noprefetch", "fp8_block+fp8_kv"),
        "fp8_unsummed_over_summed_decode": ("fp8_block+fp8_kv", "fp8_block+fp8_kv_summed"),
        "fp8_fused_act_over_unfused_decode": ("fp8_block", "fp8_block_unfused"),
    })
    for name, (a, b) in pairs.items():
        if a in out and b in out:
            out[name] = out[a]["decode_tok_s"] / out[b]["decode_tok_s"]
    if "fp8_block" in out and "fp8_block+fp8_kv" in out:
        out["fp8_kv_over_bf16_kv_tokens"] = (out["fp8_block+fp8_kv"]["kv_pool_tokens"]
                                             / out["fp8_block"]["kv_pool_tokens"])
    return out


def train_linears(shape: str, tokens: int, steps: int) -> dict:
    """Forward + backward of one decoder layer's MLP (up, SiLU, down), bf16 vs each format
    (fp8_block: native FP8 GEMMs where the device has them; mxfp8/nvfp4 emulated), tokens/s."""
    from milepost.lowprec.contract import Contract
    from milepost.lowprec.linear import apply_train_precision

    cfg = bench_models.SHAPES[shape][2]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    out = {"shape": shape, "tokens": tokens}
    for fmt in ("bf16", "fp8_block", "mxfp8", "nvfp4"):
        torch.manual_seed(0)
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.up_proj = torch.nn.Linear(h, i, bias=False)
        layer.mlp.down_proj = torch.nn.Linear(i, h, bias=False)
        m = torch.nn.Module()
        m.model = torch.nn.Module()
        m.model.layers = torch.nn.ModuleList([layer])
        m = m.cuda().to(torch.bfloat16)
        if fmt != "bf16":
            apply_train_precision(m, Contract(fmt, fmt))
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step(layer: torch.nn.Module = layer, x: torch.Tensor = x) -> None:
            y = layer.mlp.down_proj(F.silu(layer.mlp.up_proj(x)))
            y.float().square().mean().backward()

        try:
            ms = cuda_ms(step, steps)
        except Exception as e:  # noqa: BLE001 - report, go on with the next format
            out[fmt] = f"failed: {str(e).splitlines()[0][:200]}"
            print(json.dumps({fmt: out[fmt]}), flush=True)
            continue
        out[fmt] = {"ms": ms, "tok_s": tokens / ms * 1e3}
        print(json.dumps({fmt: out[fmt]}), flush=True)
    return out


def load_decode_table(path: str) -> dict:
    """Put the sweep's best config per (N, K, M) into fp8_gemm.DECODE_TABLE; what changed."""
    from milepost.kernels import fp8_gemm as fg

    changed = {}
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:  # the sweep did not finish: the committed table runs
        print(f"--decode-table {path} not read ({e!r:.120}); DECODE_TABLE as committed", flush=True)
        return {"not_read": repr(e)[:200]}
    for r in rows:
        if r.get("best"):
            key = (r["N"], r["K"], next(b for b in fg.DECODE_BUCKETS if r["M"] <= b))
            cfg = fg.DecodeConfig(*r["best"])
            if fg.DECODE_TABLE.get(key) != cfg:
                changed[str(key)] = {"was": list(fg.DECODE_TABLE[key]) if key in fg.DECODE_TABLE else None,
                                     "now": list(cfg), "us": r["best_us"]}
                fg.DECODE_TABLE[key] = cfg
    print(json.dumps({"decode_table_changed": changed}), flush=True)
    return changed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--parts", default="gemm,engine,train", help="of gemm, engine, train, int4")
    p.add_argument("--modes", default=",".join(MODES), help="engine part: which of " + ", ".join(MODES))
    p.add_argument("--decode-table", default=None,
                   help="a benchmarks/fp8_gemm_sweep.py JSON: its best configs replace DECODE_TABLE's "
                        "entries for this run (the engine then runs what was just measured)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: the engine part only (a dry run)")
    a = p.parse_args()
    shapes = a.shapes.split(",")
    result: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d")}
    parts = a.parts.split(",")
    if a.decode_table:
        result["decode_table"] = load_decode_table(a.decode_table)
    if "gemm" in parts:
        result["gemm"] = [r for s in shapes for r in gemms(s)]
        gc.collect()
        torch.cuda.empty_cache()
    if "int4" in parts:
        result["int4_gemm"] = [r for s in shapes for r in int4_gemms(s)]
        gc.collect()
        torch.cuda.empty_cache()
    if "engine" in parts:
        result["engine"] = []
        for s in shapes:
            try:
                result["engine"].append(engine_decode(s, a.requests, a.prompt, a.output, a.device,
                                                        tuple(a.modes.split(","))))
            except Exception as e:  # noqa: BLE001 - report, go on with the next shape
                result["engine"].append({"shape": s, "failed": repr(e)[:300]})
                print(json.dumps(result["engine"][-1]), flush=True)
    if "train" in parts:
        result["train"] = [train_linears(s, 4096, 10) for s in shapes]
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
