"""Where a step's time goes on the GPU: one prefill forward and one decode step of the Qwen3-0.6B
shape (or the 30B-A3B MoE shape with `--shape moe`), split into kernel times (torch.profiler), graph replay, host-side batch filling and
sampling; plus the attention kernels alone against SDPA (flash) on the same shapes.

Usage: python benchmarks/engine_gpu_profile.py [--shape dense|moe] [--requests 256] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_gpu import hf_config, make_engine, random_model
from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams, sample
from milepost.engine.scheduler import Chunk


def _req(i: int, n: int, vocab: int, blocks: list[int]) -> Request:
    ids = torch.randint(10, vocab, (n,)).tolist()
    r = Request(rid=str(i), prompt_ids=ids, params=SamplingParams(temperature=1.0, ignore_eos=True),
                on_output=lambda o: None, stop_ids=frozenset())
    r.blocks = blocks
    return r


def _cuda_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _wall_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _top_kernels(fn, title: str, n: int = 14) -> None:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- {title}: top CUDA kernels ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60))


def profile_steps(a) -> None:
    cfg = hf_config(a.shape)
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(cfg, Path(tmp))
        n, p, bs = a.requests, a.prompt_len, 16
        per = -(-(p + 64) // bs)
        engine, _ = make_engine(model, Path(tmp), n, n * per * bs + 64 * bs, 16384)
        runner = engine.runner
        reqs = [_req(i, p, cfg.vocab_size, list(range(i * per, (i + 1) * per))) for i in range(n)]
        pre = [Chunk(r, 0, p) for r in reqs]
        print(f"prefill forward {n}x{p}: {_wall_ms(lambda: runner.forward(pre), 3):.2f} ms wall")
        for r in reqs:
            r.num_computed = p
            r.output_ids = [5]
        dec = [Chunk(r, p, 1) for r in reqs]
        print(f"decode step (graph, bs={n}, ctx {p + 1}): {_wall_ms(lambda: runner.forward(dec)):.3f} ms wall")
        g = runner.graphs._graphs[runner.graphs.sizes[-1]]
        print(f"  graph replay alone: {_cuda_ms(g.replay):.3f} ms GPU")
        _top_kernels(g.replay, "decode graph replay", 20)
        fill = runner.graphs.host
        from milepost.engine.forward_batch import fill_decode

        t0 = time.perf_counter()
        for _ in range(20):
            fill_decode(fill, dec, n, bs)
        print(f"  fill_decode host: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms")
        logits = runner.forward(dec)
        params = [r.params for r in reqs]
        gens = [engine._generator] * n
        banned = [[] for _ in reqs]
        print(f"  sample(T=1, {n} rows): {_wall_ms(lambda: sample(logits, params, gens, banned, 0)):.3f} ms wall, "
              f"{_cuda_ms(lambda: sample(logits, params, gens, banned, 0)):.3f} ms GPU; fused: "
              f"{_wall_ms(lambda: sample(logits, params, gens, banned, 0, fused=True)):.3f} ms wall, "
              f"{_cuda_ms(lambda: sample(logits, params, gens, banned, 0, fused=True)):.3f} ms GPU")
        with torch.inference_mode():
            print(f"  eager decode forward: {_wall_ms(lambda: runner._forward_eager(dec)):.3f} ms wall")
        with torch.inference_mode():
            _top_kernels(lambda: runner._forward_eager(dec), "eager decode forward")
        big = [Chunk(r, 0, 1024) for r in [_req(i, 1024, cfg.vocab_size, list(range(i * 65, (i + 1) * 65)))
                                           for i in range(16)]]
        print(f"prefill forward 16x1024: {_wall_ms(lambda: runner.forward(big), 3):.2f} ms wall")
        runner.attention.sdpa_for_fresh_prefill = True
        print(f"prefill forward 16x1024, SDPA for fresh prompts: "
              f"{_wall_ms(lambda: runner.forward(big), 3):.2f} ms wall")
        runner.attention.sdpa_for_fresh_prefill = False
        with torch.inference_mode():
            _top_kernels(lambda: sample(logits, params, gens, banned, 0), "sample T=1", 8)
        with torch.inference_mode():
            _top_kernels(lambda: runner._forward_eager(big), "prefill forward 16x1024")
        engine.close()


def kernel_configs() -> None:
    import triton

    from milepost.kernels import paged_attention as K

    torch.manual_seed(0)
    seqs, L, H, Hkv, D, page = 16, 1024, 16, 8, 128, 16
    nb = seqs * L // page
    kc = torch.randn(nb * page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(seqs * L, H, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(nb, device="cuda").view(seqs, -1)
    seq_lens = torch.full((seqs,), L, device="cuda")
    cu = torch.arange(0, seqs * L + 1, L, device="cuda")
    flops = 4 * seqs * H * D * L * L / 2
    qs = q.view(seqs, L, H, D).transpose(1, 2)
    ks = kc.view(seqs, L, Hkv, D).transpose(1, 2)
    vs = vc.view(seqs, L, Hkv, D).transpose(1, 2)
    sdpa = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, enable_gqa=True), return_mode="median")
    print(f"SDPA causal 16x1024: {sdpa:.3f} ms = {flops / sdpa / 1e9:.0f} TFLOP/s")
    for bm, bn, w, st in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
                          (64, 64, 4, 3), (128, 32, 4, 2), (64, 128, 4, 2)]:
        ts, tm = K.prefill_tiles([L] * seqs, bm)
        ts, tm = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (ts, tm))

        def run():
            out = torch.empty_like(q)
            K._prefill_kernel[(ts.shape[0], H)](
                q, kc, vc, out, tables, seq_lens, cu, ts, tm, D**-0.5, q.stride(0), q.stride(1),
                kc.stride(0), kc.stride(1), tables.stride(0), out.stride(0), out.stride(1),
                GROUP=H // Hkv, D=D, PAGE=page, BLOCK_M=bm, BLOCK_N=bn, IEEE=False,
                num_warps=w, num_stages=st)
        try:
            ms = triton.testing.do_bench(run, return_mode="median")
            print(f"prefill kernel BM={bm} BN={bn} warps={w} stages={st}: {ms:.3f} ms = "
                  f"{flops / ms / 1e9:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            print(f"prefill kernel BM={bm} BN={bn} warps={w} stages={st}: failed {e!r:.200}")
    for B, ctx in ((256, 256), (256, 512), (64, 1024)):
        nb = B * ctx // page
        kc = torch.randn(nb * page, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        qd = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(nb, device="cuda").view(B, -1)
        lens = torch.full((B,), ctx, device="cuda")
        gb = 2 * kc.numel() * 2 / 1e9
        best = []
        for splits in (1, 2):
            for bn in (32, 64, 128):
                for warps in (2, 4, 8):
                    for stages in (1, 2, 3, 4):
                        try:
                            ms = triton.testing.do_bench(lambda: K.paged_decode(
                                qd, kc, vc, tables, lens, D**-0.5, page, splits, block_n=bn,
                                num_warps=warps, num_stages=stages), return_mode="median")
                        except Exception as e:  # noqa: BLE001 - a config that does not compile
                            print(f"decode B={B} ctx={ctx} splits={splits} BN={bn} w={warps} "
                                  f"st={stages}: failed {e!r:.120}")
                            continue
                        best.append((ms, splits, bn, warps, stages))
        best.sort()
        print(f"decode B={B} ctx={ctx} (KV {gb:.3f} GB; default at splits=1: BN=64 w=2 st=3): best " + "; ".join(
            f"splits={s} BN={bn} w={w} st={st} {ms * 1e3:.1f} us = {gb / ms:.0f} TB/s"
            for ms, s, bn, w, st in best[:6]))
        today = [b for b in best if b[1:] == (1, 64, 2, 3)]
        if today:
            print(f"  the default config: {today[0][0] * 1e3:.1f} us = {gb / today[0][0]:.0f} TB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--shape", choices=("dense", "moe"), default="dense")
    ap.add_argument("what", nargs="*", default=["steps", "kernels"])
    a = ap.parse_args()
    if "kernels" in a.what:
        kernel_configs()
    if "steps" in a.what:
        profile_steps(a)


if __name__ == "__main__":
    main()
