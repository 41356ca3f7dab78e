"""Where the FP8 blockwise trainer's time goes, per linear (issue 23: FP8 training ran at 0.62x bf16).

For each Qwen3-4B projection (hidden 2560, intermediate 9728: q, k, v, o, gate, up, down) at the
tokens of one `milepost bench train` micro-batch (16384), with CUDA events after warm-up:

- forward + backward of one linear: bf16, FP8 current scaling and FP8 delayed scaling (history
  filled by one step first), each with the unfused quantize passes (Fp8TrainOptions.unfused(), the path before 2026-12-06) and with the options given by
  --weight-quant/--act-quant/--transpose (default: all fused; milepost/lowprec/fp8_options.py);
- the FP8 current-scaling time split into its parts: weight quantize (torch quantizer vs one-pass
  Triton), activation quantize (forward input, output gradient), the backward's transposed
  operands (pad + transposing copies, their quantize; or the fused strided quantize), the weight
  transpose, and the three GEMMs (forward, data gradient, weight gradient) on the chosen backends;
  beside them the bf16 GEMMs and a per-tensor FP8 `_scaled_mm` of the same shape (what FP8
  tensor cores give without block scales).

`--profile-step` adds a train step of a small model (two Qwen3-4B-shaped layers of the seven
projections, glue but no attention): ms per step in bf16, FP8 unfused and FP8 with the options, and
torch.profiler's top kernels of one FP8 step each. Prints a table; `--json-out` writes it all.
`--device cpu --small` runs tiny shapes (Triton under its interpreter; GEMMs emulated) so a test
can check that the script runs; its numbers say nothing about a GPU.

    python benchmarks/fp8_train_profile.py --json-out $OUT/fp8_train_profile.json --profile-step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from milepost.lowprec.fp8_options import Fp8TrainOptions  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 2560, 9728, 32, 8, 128  # Qwen3-4B
SHAPES = {  # name: (out features N, in features K)
    "q": (HEADS * HEAD_DIM, HIDDEN), "k": (KV_HEADS * HEAD_DIM, HIDDEN), "v": (KV_HEADS * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER),
}
SMALL = {"q": (256, 128), "down": (128, 256)}


def timer(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int) -> float:
    """Milliseconds per call of `fn` (mean of `reps` after `warmup`; CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / reps
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def fp8_linear(n: int, k: int, device: torch.device, dtype: torch.dtype, opts: Fp8TrainOptions,
               seed: int = 0) -> nn.Linear:
    """A trainer FP8 blockwise linear (the class apply_train_precision swaps in)."""
    from milepost.lowprec.linear import LowPrecLinear

    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    lin.__class__ = LowPrecLinear
    lin.qformat, lin.four_over_six, lin.dequantized_backward = "fp8_block", False, False
    lin.fp8_options = opts
    return lin


def delayed_linear(n: int, k: int, device: torch.device, dtype: torch.dtype, x: torch.Tensor,
                   gy: torch.Tensor, opts: Fp8TrainOptions) -> nn.Linear:
    """An FP8 linear under --fp8-scaling delayed whose history holds one step (scales in use)."""
    from milepost.lowprec.delayed import DelayedScaling, DelayedSettings

    lin = fp8_linear(n, k, device, dtype, opts)
    state = DelayedScaling(["w"], DelayedSettings(), device)
    lin.__dict__["_delayed"] = (state, (state.slot("w", "x"), state.slot("w", "gy")), True)
    lin(x).backward(gy)
    state.step()
    return lin


def fwd_bwd(lin: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        lin.weight.grad = None
        x.grad = None
        lin(x).backward(gy)
    return run


def parts(n: int, k: int, x: torch.Tensor, gy: torch.Tensor, w: torch.Tensor, device: torch.device,
          t: Callable[[Callable[[], Any]], float]) -> dict[str, float]:
    """ms of each pass of the native FP8 current-scaling linear, the unfused and the fused kernels'."""
    from milepost.kernels.fp8_train_quant import quantize_blocks, quantize_weight_tiles
    from milepost.lowprec.quantize import quantize

    cuda = device.type == "cuda"
    if cuda:
        from milepost.kernels import fp8_gemm as fg
        from milepost.kernels.fp8_gemm_train import wgrad_backend

        backend, rows = fg.block_backend(device), wgrad_backend(device)
    else:  # the GEMMs' emulated forms: the script's smoke test only
        from milepost.kernels import fp8_gemm as fg

        backend, rows = "emulated", "emulated"
    gemm = {"scaled_mm": fg.scaled_mm_block, "triton": fg.triton_block_mm,
            "emulated": fg.emulated_block_mm}[backend]
    pad_rows = 4 if backend == "scaled_mm" else 1
    multiple = 4 * 128 if rows == "scaled_mm" else 128
    tokens = x.shape[0]
    pad = (-tokens) % multiple
    q = quantize(w, "fp8_block", "weight")
    wv, ws = q.values, q.scales
    wt, wst = wv.t().contiguous(), ws.t().contiguous()
    xq, sx = fg.quantize_act_1x128(x, pad_rows)
    gq, sg = fg.quantize_act_1x128(gy, pad_rows)
    gtq, sgt = quantize_blocks(gy.t(), 1, multiple)
    xtq, sxt = quantize_blocks(x.t(), 1, multiple)
    out = {
        "weight_quant_torch": t(lambda: quantize(w, "fp8_block", "weight")),
        "weight_quant_triton": t(lambda: quantize_weight_tiles(w, False)),
        "weight_quant_triton_with_t": t(lambda: quantize_weight_tiles(w, True)),
        "weight_transpose": t(lambda: (wv.t().contiguous(), ws.t().contiguous())),
        "act_quant_x_rows": t(lambda: fg.quantize_act_1x128(x, pad_rows)),
        "act_quant_x_tiled": t(lambda: quantize_blocks(x, pad_rows)),
        "act_quant_gy_rows": t(lambda: fg.quantize_act_1x128(gy, pad_rows)),
        "act_quant_gy_tiled": t(lambda: quantize_blocks(gy, pad_rows)),
        "transpose_copy_gy_x": t(lambda: (F.pad(gy.t(), (0, pad)).contiguous(),
                                          F.pad(x.t(), (0, pad)).contiguous())),
        "transpose_quant_copy": t(lambda: (fg.quantize_act_1x128(F.pad(gy.t(), (0, pad)).contiguous()),
                                           fg.quantize_act_1x128(F.pad(x.t(), (0, pad)).contiguous()))),
        "transpose_quant_fused": t(lambda: (quantize_blocks(gy.t(), 1, multiple),
                                            quantize_blocks(x.t(), 1, multiple))),
        "gemm_fwd": t(lambda: gemm(xq, sx, wv, ws, x.dtype)),
        "gemm_dgrad": t(lambda: gemm(gq, sg, wt, wst, x.dtype)),
        "gemm_wgrad": t(lambda: fg.rows_mm(gtq, sgt, xtq, sxt, x.dtype, rows)),
        "bf16_gemm_fwd": t(lambda: x @ w.t()),
        "bf16_gemm_dgrad": t(lambda: gy @ w),
        "bf16_gemm_wgrad": t(lambda: gy.t() @ x),
    }
    if cuda:  # per-tensor FP8 (scalar scales): the FP8 tensor cores without block scales
        one = torch.ones((), device=device)
        a8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        try:
            out["tensorwise_fp8_gemm_fwd"] = t(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one,
                                                                        out_dtype=x.dtype))
        except RuntimeError as e:  # noqa: PERF203 - report, do not stop the profile
            print(f"  per-tensor _scaled_mm not timed: {str(e).splitlines()[0][:120]}")
    out["backend"], out["wgrad_backend"] = backend, rows  # type: ignore[assignment]
    return out


def check_bits(x: torch.Tensor, w: torch.Tensor) -> dict[str, bool]:
    """The fused kernels' bytes against the unfused ones', on this device's operands (the A/B's premise)."""
    from milepost.kernels.fp8_quant import quantize_act_1x128
    from milepost.kernels.fp8_train_quant import quantize_blocks, quantize_weight_tiles
    from milepost.lowprec.quantize import quantize

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))

    q = quantize(w, "fp8_block", "weight")
    v, s, vt = quantize_weight_tiles(w, True)
    xt = quantize_act_1x128(F.pad(x.t(), (0, (-x.shape[0]) % 128)).contiguous())
    ft = quantize_blocks(x.t())
    rows, tiled = quantize_act_1x128(x, 4), quantize_blocks(x, 4)
    return {"weight": same(v, q.values) and torch.equal(s, q.scales) and same(vt, v.t().contiguous()),
            "transposed_operand": same(ft[0], xt[0]) and torch.equal(ft[1], xt[1]),
            "tiled_rows": same(tiled[0], rows[0]) and torch.equal(tiled[1], rows[1])}


def profile_linear(name: str, n: int, k: int, args: argparse.Namespace, device: torch.device,
                   opts: Fp8TrainOptions) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, k, device=device, dtype=dtype, generator=g).requires_grad_(True)
    gy = torch.randn(args.tokens, n, device=device, dtype=dtype, generator=g) * 1e-3
    def t(fn: Callable[[], Any]) -> float:
        return timer(fn, device, args.reps, args.warmup)

    bf16 = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    row: dict[str, Any] = {"name": name, "N": n, "K": k, "tokens": args.tokens,
                           "bf16_ms": t(fwd_bwd(bf16, x, gy))}
    row["fp8_current_ms"] = t(fwd_bwd(fp8_linear(n, k, device, dtype, Fp8TrainOptions.unfused()), x, gy))
    if opts != Fp8TrainOptions.unfused():
        row["fp8_current_options_ms"] = t(fwd_bwd(fp8_linear(n, k, device, dtype, opts), x, gy))
    row["fp8_delayed_ms"] = t(fwd_bwd(delayed_linear(n, k, device, dtype, x, gy, Fp8TrainOptions.unfused()), x, gy))
    if opts != Fp8TrainOptions.unfused():
        row["fp8_delayed_options_ms"] = t(fwd_bwd(delayed_linear(n, k, device, dtype, x, gy, opts), x, gy))
    with torch.no_grad():
        row["parts_ms"] = parts(n, k, x.detach(), gy, bf16.weight.detach(), device, t)
        if args.check_bits:
            row["bits_equal"] = check_bits(x.detach(), bf16.weight.detach())
    return row


class _Layer(nn.Module):
    """The seven projections of a Qwen3 layer with cheap glue (no attention): the linears' step."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.proj = nn.ModuleDict({n: nn.Linear(k, o, bias=False) for n, (o, k) in shapes.items()})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        p = self.proj
        if "k" in p:
            a = p["q"](h) + p["k"](h).repeat(1, HEADS // KV_HEADS) * p["v"](h).repeat(1, HEADS // KV_HEADS)
            h = h + p["o"](a)
        if "gate" in p:
            h = h + p["down"](F.silu(p["gate"](h)) * p["up"](h))
        else:
            h = h + p["down"](F.silu(p["q"](h)))
        return h


def profile_step(args: argparse.Namespace, device: torch.device, opts: Fp8TrainOptions | None
                 ) -> dict[str, Any]:
    """ms per train step (2 layers; SGD) and torch.profiler's top kernels of one, after a warm-up
    step; opts None: the bf16 model (timed only)."""
    from torch.profiler import ProfilerActivity, profile

    from milepost.lowprec.linear import LowPrecLinear

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMALL if args.small else SHAPES
    torch.manual_seed(0)
    model = nn.Sequential(*[_Layer(shapes) for _ in range(2)]).to(device, dtype)
    for m in model.modules():
        if type(m) is nn.Linear and opts is not None:
            m.__class__ = LowPrecLinear
            m.qformat, m.four_over_six, m.dequantized_backward, m.fp8_options = "fp8_block", False, False, opts
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    h = torch.randn(args.tokens, HIDDEN if not args.small else 128, device=device, dtype=dtype)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(h).float().pow(2).mean().backward()
        opt.step()

    step_ms = timer(step, device, max(1, args.reps // 4), 1)
    if opts is None:
        print(f"\nbf16 train step (2 layers, {args.tokens} tokens): {step_ms:.3f} ms")
        return {"options": None, "step_ms": step_ms}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[: args.top]
    total = sum(getattr(e, key, 0.0) for e in prof.key_averages())
    top = [{"name": e.key[:90], "calls": e.count, "ms": getattr(e, key, 0.0) / 1e3} for e in events]
    print(f"\nFP8 train step (2 layers, {args.tokens} tokens, options {opts}): {step_ms:.3f} ms; top kernels:")
    for e in top:
        print(f"  {e['ms']:9.3f} ms  {e['calls']:5d}x  {e['name']}")
    return {"options": opts.__dict__, "step_ms": step_ms, "profiled_ms": total / 1e3, "top": top}


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'linear':6s} {'N':>6s} {'K':>6s} {'bf16':>8s} {'fp8':>8s} {'fp8 opt':>8s} {'delayed':>8s} "
          f"{'del. opt':>8s}  (fwd+bwd ms; opt: the options of --weight-quant/--act-quant/--transpose)")
    nan = float("nan")
    for r in rows:
        print(f"{r['name']:6s} {r['N']:6d} {r['K']:6d} {r['bf16_ms']:8.3f} {r['fp8_current_ms']:8.3f} "
              f"{r.get('fp8_current_options_ms', nan):8.3f} {r['fp8_delayed_ms']:8.3f} "
              f"{r.get('fp8_delayed_options_ms', nan):8.3f}")
    keys = [k for k, v in rows[0]["parts_ms"].items() if isinstance(v, float)]
    print(f"\nFP8 current-scaling parts (ms; GEMM backend {rows[0]['parts_ms']['backend']}, "
          f"weight gradient {rows[0]['parts_ms']['wgrad_backend']})")
    print(f"{'part':28s}" + "".join(f"{r['name']:>9s}" for r in rows))
    for k in keys:
        print(f"{k:28s}" + "".join(f"{r['parts_ms'].get(k, float('nan')):9.3f}" for r in rows))
    for r in rows:
        if "bits_equal" in r:
            print(f"bits equal ({r['name']}): {r['bits_equal']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="tiny shapes and tokens (CPU smoke test)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (default 16384, "
                   "`milepost bench train`'s --micro-batch-tokens; --small: 200)")
    p.add_argument("--linears", default=None, help=f"comma list of {','.join(SHAPES)} (default all)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--weight-quant", choices=("torch", "triton"), default="triton",
                   help="the 'fp8 opt' column's weight quantizer (unfused: torch)")
    p.add_argument("--act-quant", choices=("rows", "tiled"), default="tiled",
                   help="the 'fp8 opt' column's activation quantizer (unfused: rows)")
    p.add_argument("--transpose", choices=("copy", "fused"), default="fused",
                   help="the 'fp8 opt' column's weight-gradient operands (unfused: copy)")
    p.add_argument("--check-bits", action="store_true", help="compare the fused kernels' bytes with the unfused ones'")
    p.add_argument("--profile-step", action="store_true", help="torch.profiler top kernels of one train step")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu --small for the smoke run")
    if args.tokens is None:
        args.tokens = 200 if args.small else 16384
    table = SMALL if args.small else SHAPES
    names = args.linears.split(",") if args.linears else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--linears: unknown {unknown}; choose from {list(table)}")
    opts = Fp8TrainOptions(args.weight_quant, args.act_quant, args.transpose)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    rows = [profile_linear(n, *table[n], args, device, opts) for n in names]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "tokens": args.tokens, "options": opts.__dict__,
                              "linears": rows}
    _print(rows)
    total = {k: sum(r[k] for r in rows) for k in ("bf16_ms", "fp8_current_ms", "fp8_delayed_ms")}
    if opts != Fp8TrainOptions.unfused():
        for k in ("fp8_current_options_ms", "fp8_delayed_options_ms"):
            total[k] = sum(r[k] for r in rows)
    report["sum_ms"] = total
    print("\nsum over the linears (one layer, fwd+bwd ms): "
          + ", ".join(f"{k.removesuffix('_ms')} {v:.3f} (x{total['bf16_ms'] / v:.2f} bf16 speed)"
                      for k, v in total.items()))
    if args.profile_step:
        report["profile_step"] = {"bf16": profile_step(args, device, None),
                                  "unfused": profile_step(args, device, Fp8TrainOptions.unfused())}
        if opts != Fp8TrainOptions.unfused():
            report["profile_step"]["options"] = profile_step(args, device, opts)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
