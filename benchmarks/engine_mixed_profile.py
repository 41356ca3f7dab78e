"""Why prefill and mixed (prefill + running decodes) engine steps cost what they cost, and which
chunked-prefill budget benchmark (a) wants: one GPU call per shape.

1. `steps`: forwards built by hand on the engine's runner (no engine thread): prefill-only
   batches of 128-token prompts of 2k..32k tokens, and mixed batches (prompts + 128 decodes at
   201 keys) of the same budgets, each timed as host launch time (forward returns), wall (after a
   sync) and GPU time (events); the mixed 2k batch with the decode rows through the prefill
   kernel (before) and the decode kernel (now); a torch.profiler table and a cProfile of it.
   The mixed step's time is the inter-token latency running decodes see while prompts arrive.
2. `sweep`: benchmark (a) (256 x 128 -> 256, routed experts recorded) on one engine per
   chunked-prefill budget, each after a short warm-up at that budget, with the step timeline;
   at 2048 also with the decode rows through the prefill kernel (the old path); on the dense
   shape also the mixed scenario (lengths 100..1024) per budget, for its inter-token latency.

3. `attention`: the decode attention kernel alone at the shape's heads, configs around the engine's.

Usage: PYTHONPATH=$PWD python benchmarks/engine_mixed_profile.py --shape qwen3-0.6b [steps attention sweep]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from milepost.bench import workloads
from milepost.bench.engine_side import EngineBench
from milepost.bench.models import native_model
from milepost.bench.timeline import format_summary
from milepost.engine.request import Request
from milepost.engine.sampling_params import SamplingParams
from milepost.engine.scheduler import Chunk
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine


def _attention(runner: object) -> object:
    att = runner.attention
    return getattr(att, "base", att)  # VariantPagedAttention wraps the Triton backend


class _Batches:
    """Requests with KV blocks handed out from the front of the pool (the engine holds none yet)."""

    def __init__(self, vocab: int, block: int) -> None:
        self.vocab, self.block, self.next_block, self.n = vocab, block, 0, 0

    def req(self, length: int) -> Request:
        ids = torch.randint(10, self.vocab, (length,)).tolist()
        self.n += 1
        r = Request(rid=f"p{self.n}", prompt_ids=ids,
                    params=SamplingParams(temperature=1.0, ignore_eos=True),
                    on_output=lambda o: None, stop_ids=frozenset())
        need = -(-(length + 1) // self.block)
        r.blocks = list(range(self.next_block, self.next_block + need))
        self.next_block += need
        return r

    def prefill(self, n: int, p: int = 128) -> list[Chunk]:
        return [Chunk(self.req(p), 0, p) for _ in range(n)]

    def decodes(self, n: int, ctx: int = 200) -> list[Chunk]:
        out = []
        for _ in range(n):
            r = self.req(ctx)
            r.num_computed = ctx
            r.output_ids = [5]
            out.append(Chunk(r, ctx, 1))
        return out


def _time(runner: object, chunks: list[Chunk], reps: int = 5) -> tuple[float, float, float]:
    """Median (host launch ms, wall ms, GPU ms) of runner.forward(chunks)."""
    cuda = torch.cuda.is_available()  # CPU: a check of this script (gpu = wall)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runner.forward(chunks)
    sync()
    launch, wall, gpu = [], [], []
    for _ in range(reps):
        a, b = (torch.cuda.Event(enable_timing=True) for _ in "ab") if cuda else (None, None)
        t0 = time.perf_counter()
        if cuda:
            a.record()
        runner.forward(chunks)
        if cuda:
            b.record()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        launch.append(1e3 * (t1 - t0))
        wall.append(1e3 * (t2 - t0))
        gpu.append(a.elapsed_time(b) if cuda else wall[-1])
    return statistics.median(launch), statistics.median(wall), statistics.median(gpu)


def fused_past_4096(on: bool) -> bool:
    """MoE (30B-A3B expert shape): on = token counts past the measured 4096 also take the fused
    path with the 4096 config (kernels/fused_moe.py MEASURED); off = the committed table. Returns
    whether the shape is in the table."""
    from milepost.kernels import fused_moe

    key = (128, 2048, 768, 8)
    table = fused_moe.MEASURED.get(key)
    if table is None:
        return False
    base = tuple(b for b in table if b[0] <= 4096)
    fused_moe.MEASURED[key] = base + (((1 << 30, base[-1][1]),) if on else ())
    return True


def _gpu_ms(fn, reps: int = 30) -> float:
    """Median GPU time of fn (CUDA events); CPU: wall."""
    fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _same(seen: dict, key: str, value: torch.Tensor) -> bool:
    """Whether value equals (bitwise) the first value recorded under key."""
    first = seen.setdefault(key, value.clone())
    return bool(torch.equal(first, value))


def router_ab(runner: object) -> None:
    """MoE: the 48 MoE blocks of a decode step (256 tokens) in one CUDA graph with each router
    (`SparseMoeBlock.router_kernels`: torch ops, the fused end, the whole router in one kernel):
    time, and outputs + records compared with the torch ops'."""
    from milepost.models.base import ForwardContext
    from milepost.models.qwen3_moe import SparseMoeBlock

    default = SparseMoeBlock.router_kernels

    model = runner.model
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    if not blocks or not torch.cuda.is_available():
        return
    torch.manual_seed(0)
    x = torch.randn(256, model.hf_config.hidden_size, device="cuda", dtype=torch.bfloat16)
    res = {}
    for kernels in ("torch", "finish", "fused"):
        SparseMoeBlock.router_kernels = kernels
        rec = torch.full((256, model.num_layers, model.moe_top_k), -1, dtype=torch.int32, device="cuda")
        ctx = ForwardContext(attention=None, routed_experts=rec)
        with torch.inference_mode():
            outs = [b(x, ctx) for b in blocks]
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for b in blocks:
                    b(x, ctx)
        ms = _gpu_ms(graph.replay)
        res[kernels] = (torch.stack(outs), rec.clone())
        line = f"  MoE blocks x{len(blocks)} at 256 tokens (one graph), router {kernels}: {ms:.3f} ms"
        if kernels != "torch":
            out, want = res[kernels][0].float(), res["torch"][0].float()
            line += (f"; vs torch ops: outputs bitwise equal {torch.equal(out, want)} (max |diff| "
                     f"{(out - want).abs().max().item():.2e}), recorded experts equal "
                     f"{torch.equal(res[kernels][1], res['torch'][1])}, as sets "
                     f"{torch.equal(res[kernels][1].sort(-1).values, res['torch'][1].sort(-1).values)}")
        print(line, flush=True)
        del graph
    with torch.inference_mode():  # would softmax(dtype=fp32) on the bf16 gate output do (one launch)?
        gl = [b.gate(x) for b in blocks]
        same = all(torch.equal(torch.softmax(g.float(), dim=-1), torch.softmax(g, dim=-1, dtype=torch.float32))
                   for g in gl)
        t_two = _gpu_ms(lambda: [torch.softmax(g.float(), dim=-1) for g in gl])
        t_one = _gpu_ms(lambda: [torch.softmax(g, dim=-1, dtype=torch.float32) for g in gl])
    print(f"  router softmax of bf16 logits: .float() then softmax vs softmax(dtype=fp32): bitwise equal "
          f"{same}; eager x{len(gl)}: {t_two:.3f} vs {t_one:.3f} ms", flush=True)
    SparseMoeBlock.router_kernels = default


def profile_steps(engine: object, shape: str, budgets: list[int]) -> None:
    runner = engine.runner
    att = _attention(runner)
    mk = _Batches(runner.model.vocab_size, engine.cfg.block_size)
    print(f"== steps ({shape}): forwards on the runner, median of 5; launch = until forward returns, "
          "wall = after a sync, gpu = CUDA events", flush=True)
    for c in budgets:
        pre = mk.prefill(c // 128)
        mixed = mk.decodes(128) + mk.prefill((c - 128) // 128)
        for name, chunks in ((f"prefill {c // 128} x 128", pre),
                             (f"mixed {(c - 128) // 128} x 128 + 128 decodes", mixed)):
            la, wa, g = _time(runner, chunks)
            tok = sum(ch.length for ch in chunks)
            print(f"  budget {c:6d} {name:34s} launch {la:7.2f} ms  wall {wa:7.2f} ms  gpu {g:7.2f} ms"
                  f"  ({tok / wa * 1e3 / 1e3:,.0f}k tok/s wall)", flush=True)
        if c > 4096 and runner.model.moe_top_k and fused_past_4096(True):
            la, wa, g = _time(runner, pre)
            fused_past_4096(False)
            print(f"  budget {c:6d} {'  same prefill, fused MoE (4096 cfg)':34s} launch {la:7.2f} ms  "
                  f"wall {wa:7.2f} ms  gpu {g:7.2f} ms", flush=True)
        mk.next_block = 0  # reuse the blocks: every batch writes its own KV before reading it
    mixed = mk.decodes(128) + mk.prefill(15)
    for split in (False, True):
        att.split_mixed_decodes = split
        la, wa, g = _time(runner, mixed)
        print(f"  mixed 2048, decode rows through the {'decode' if split else 'prefill'} kernel: "
              f"launch {la:.2f} ms, wall {wa:.2f} ms, gpu {g:.2f} ms", flush=True)
    att.split_mixed_decodes = True
    dec = mk.decodes(256)
    from milepost.models.layers import DecoderLayer

    # graphs captured again for each: the switch is read while capturing (dense shape only: the
    # MoE shape's 48 layers take long to capture)
    from milepost.engine.cuda_graph import DecodeGraphs
    from milepost.engine.sampling import sample

    params = [c.req.params for c in dec]
    gens = [engine._generator] * len(dec)
    banned = [[] for _ in dec]

    def step() -> None:  # the decode step's GPU work: graph replay, then the (fused) sampler
        sample(runner.forward(dec), params, gens, banned, 0, fused=engine.cfg.fused_sampler)

    seen: dict[str, torch.Tensor] = {}
    switches = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
    for fuse, raw, rope in switches if not runner.model.moe_top_k else ():
        DecoderLayer.fuse_residual_norm = fuse
        DecodeGraphs.raw_logits = raw
        att.fuse_rope_store = rope
        runner.capture_cuda_graphs()
        g = _gpu_ms(step)
        g2 = _time(runner, mixed)[2]
        same = _same(seen, "decode", runner.forward(dec).float()) and _same(seen, "mixed", runner.forward(mixed))
        print(f"  residual add + norm {'fused' if fuse else 'apart'}, graph logits "
              f"{'bf16' if raw else 'fp32'}, q/k RoPE + KV store {'one kernel' if rope else 'apart'}: decode step 256 x 201 keys (graph + sampler) gpu {g:.3f} ms; "
              f"mixed 2048 gpu {g2:.2f} ms; logits bitwise equal to the first: {same}", flush=True)
    router_ab(runner)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        runner.forward(mixed)
        if cuda:
            torch.cuda.synchronize()
    ev = prof.key_averages()
    kernels = [e for e in ev if e.device_type == DeviceType.CUDA]
    n_k = sum(e.count for e in kernels)
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"--- mixed 2048 under torch.profiler: {n_k} kernels, {busy:.2f} ms of kernel time ---")
    if cuda:
        print(ev.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=48))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        runner.forward(mixed)
    if cuda:
        torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(16)
    print("--- cProfile of 3 mixed-2048 forwards (host), by own time ---")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000], flush=True)


def decode_configs(heads: int, kv_heads: int, page: int = 16) -> None:
    """The decode attention kernel alone at this model's heads, 256 sequences: configs around the
    engine's choice (unsplit: BN 64, 2 warps, 3 stages; split: 4 warps, 2 stages)."""
    import triton

    from milepost.kernels import paged_attention as K

    torch.manual_seed(0)
    d = 128
    for b, ctx in ((256, 256), (256, 384)):
        nb = b * ctx // page
        kc = torch.randn(nb * page, kv_heads, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, heads, d, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(nb, device="cuda").view(b, -1)
        lens = torch.full((b,), ctx, device="cuda")
        gb = 2 * kc.numel() * 2 / 1e9
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        default = K.decode_splits(b, kv_heads, sms)
        res = []
        for splits in (1, 2):
            for bn in (32, 64):
                for warps in (2, 4):
                    for stages in (2, 3):
                        try:
                            ms = triton.testing.do_bench(lambda: K.paged_decode(
                                q, kc, vc, tables, lens, d**-0.5, page, splits, block_n=bn,
                                num_warps=warps, num_stages=stages), warmup=5, rep=20,
                                return_mode="median")
                        except Exception as e:  # noqa: BLE001 - a config that does not compile
                            print(f"  decode {splits}/{bn}/{warps}/{stages}: failed {e!r:.100}")
                            continue
                        res.append((ms, splits, bn, warps, stages))
        eng = triton.testing.do_bench(lambda: K.paged_decode(q, kc, vc, tables, lens, d**-0.5, page,
                                                             default), warmup=5, rep=20,
                                      return_mode="median")
        res.sort()
        print(f"decode attention {heads}/{kv_heads} heads, {b} x {ctx} keys (KV {gb:.3f} GB): engine "
              f"(splits={default}) {eng * 1e3:.1f} us = {gb / eng:.2f} TB/s; best: " + "; ".join(
                  f"splits={sp} BN={bn} w={w} st={st} {ms * 1e3:.1f} us" for ms, sp, bn, w, st in res[:5]),
              flush=True)


def sweep(engine: object, shape: str, budgets: list[int], scenarios: list[str]) -> None:
    vocab = engine.runner.model.vocab_size
    bench = EngineBench(engine, 1.0, timeline=True)
    att = _attention(engine.runner)
    n = 256 if engine.runner.device.type == "cuda" else 16  # CPU: a check of this script
    warm = {"fixed": lambda: workloads.fixed(n, 128, 4, vocab, 99),
            "mixed": lambda: workloads.mixed(n // 4, 100, 1024, vocab, 99)}
    timed = {"fixed": lambda: workloads.fixed(n, 128, 256, vocab, 0),
             "mixed": lambda: workloads.mixed(n, 100, 1024, vocab, 0)}
    runs = [(c, True, False) for c in budgets] + [(2048, False, False)]
    if engine.runner.model.moe_top_k:  # MoE: past 4096 tokens also with the fused experts
        runs += [(c, True, True) for c in budgets if c > 4096]
    for c, split, fused in runs:
        engine.scheduler.chunked_prefill_size = c
        att.split_mixed_decodes = split
        if fused:
            fused_past_4096(True)
        for sc in scenarios:
            bench.run(warm[sc]())
            r = bench.run(timed[sc]())
            tag = f"{sc} budget {c}" + ("" if split else " (decode rows in the prefill kernel)") + (
                " (fused MoE past 4096 tokens)" if fused else "")
            tok_s = r.output_tokens / r.seconds
            step = 1e3 * r.decode_seconds / max(r.decode_steps, 1)
            print(f"== {shape} {tag}: {tok_s:,.0f} tok/s, wall {r.seconds:.3f} s, decode step {step:.2f} ms",
                  flush=True)
            print("\n".join(format_summary(tag, r.timeline)), flush=True)
        if fused:
            fused_past_4096(False)
    att.split_mixed_decodes = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=("qwen3-0.6b", "qwen3-30b-a3b", "tiny"))
    ap.add_argument("--budgets", default="", help="comma-separated chunked-prefill budgets "
                    "(default 2048..32768 dense, 2048..16384 MoE)")
    ap.add_argument("--scenarios", default="", help="sweep scenarios (default fixed,mixed dense; fixed MoE)")
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--mem-fraction-static", type=float, default=0.85,
                    help="share of the GPU for weights + KV pool (on an 80 GB H100, 0.85 left "
                         "the 30B-A3B shape's random weights no pool: raise it there)")
    ap.add_argument("what", nargs="*", default=[], help="steps, attention, sweep (default: all; "
                    "attention on the MoE shape only: the dense heads were swept in session 12)")
    a = ap.parse_args()
    moe = a.shape == "qwen3-30b-a3b"
    a.what = a.what or (["steps", "attention", "sweep"] if moe else ["steps", "sweep"])
    budgets = [int(x) for x in a.budgets.split(",")] if a.budgets else (
        [2048, 4096, 8192, 16384] if moe else [2048, 4096, 8192, 16384, 32768])
    scenarios = a.scenarios.split(",") if a.scenarios else (["fixed"] if moe else ["fixed", "mixed"])
    t_start = time.perf_counter()
    pool = None
    if moe:
        from benchmarks.moe_engine_ab import precompile_async

        pool = precompile_async()
    cuda = torch.cuda.is_available()
    native, cfg_dir = native_model(None, a.shape, torch.bfloat16 if cuda else torch.float32,
                                   torch.device("cuda" if cuda else "cpu"), 0)
    sargs = ServerArgs(model_path=cfg_dir, device="cuda" if cuda else "cpu",
                       dtype="bfloat16" if cuda else "float32", max_running_requests=256,
                       chunked_prefill_size=max(budgets),
                       max_total_tokens=a.max_total_tokens or (120000 if moe else None),
                       mem_fraction_static=a.mem_fraction_static, random_seed=0).resolved()
    engine, _, _ = build_engine(sargs, model=native, record_routed_experts=True)
    print(f"engine built in {time.perf_counter() - t_start:.0f} s", flush=True)
    try:
        if "steps" in a.what:
            profile_steps(engine, a.shape, budgets)
        if "attention" in a.what and cuda:
            cfg = native.hf_config
            decode_configs(cfg.num_attention_heads, cfg.num_key_value_heads)
        engine.start()
        if "sweep" in a.what:
            sweep(engine, a.shape, budgets, scenarios)
    finally:
        engine.close()
        if pool is not None:
            pool.terminate()
    print(f"done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
