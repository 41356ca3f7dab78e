"""`milepost bench train`: the trainer's step beside a plain Hugging Face training loop, one run.

Both train the same checkpoint on the same random batch (samples x (prompt + response) tokens,
N(0, 1) advantages, one optimizer step per batch): milepost's `FSDPBackend.train_step` on one
rank (with --backend megatron|both, the Megatron backend's too; with --precision other than bf16, the
same trainer in bf16 as well, --fp8-scaling delayed or not), then the transformers loop of train_hf.py.
Prints tokens/s (all tokens of the batch over the median step time), MFU (model FLOPs / step time /
device peak), peak memory and the ratio.
Also runnable as `python -m milepost.bench.train` (needs no pydantic, unlike the CLI).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from milepost.bench.train_setup import (
    TrainBenchArgs,
    device_peak,
    parse_args,
    shape_config,
    train_flops,
    write_shape_checkpoint,
)


def _batch(args: TrainBenchArgs, vocab: int):
    from milepost.train.batch import TrainBatch

    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(10, vocab, (args.samples, args.seq_len), generator=g)
    adv = torch.randn(args.samples, args.response, generator=g)
    masks = [torch.ones(args.response) for _ in range(args.samples)]
    batch = TrainBatch(list(tokens), [args.response] * args.samples, masks, list(adv))
    return tokens, adv, batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(trainer, batch, steps: int, device: torch.device) -> dict:
    """`steps` timed train steps after one warm-up; peak memory of the timed ones (CUDA)."""
    cuda = device.type == "cuda"
    times = []
    for i in range(steps + 1):
        _sync(device)
        if i == 1 and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        metrics = trainer.train_step(batch)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t)
    return {"step_times": times, "grad_norm": metrics["grad_norm"],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")}


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _rank(rank: int, world: int, path: str, args: TrainBenchArgs, vocab: int) -> dict:
    """One process: milepost's steps (FSDP, Megatron or both, each released before the next), then
    the Hugging Face loop's."""
    from milepost.bench.train_hf import hf_train_steps
    from milepost.train.backend import create_backend
    from milepost.train.settings import TrainerSettings

    torch.manual_seed(args.seed)
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tokens, adv, batch = _batch(args, vocab)
    sides = [("milepost", "fsdp", args.precision, args.fp8_scaling),
             ("megatron", "megatron", args.precision, args.fp8_scaling)]
    if args.precision != "bf16":  # the same trainer unquantized, in this run: the format's speed-up
        sides.append(("milepost_bf16", "fsdp", "bf16", "current"))
    out = {}
    for side, name, precision, fp8_scaling in sides:
        if args.backend in (name, "both"):
            settings = TrainerSettings(
                lr=1e-6, global_batch_size=args.samples, max_tokens_per_micro_batch=args.micro_batch_tokens,
                device=args.device, dtype="bfloat16" if cuda else "float32",
                activation_checkpointing=args.activation_checkpointing, compile_layers=args.compile_layers,
                fused_kernels=args.fused_kernels, precision=precision, fp8_scaling=fp8_scaling)
            trainer = create_backend(path, settings, name)
            out[side] = _timed(trainer, batch, args.steps, device)
            if getattr(trainer, "fp8_scaling", None) is not None:  # delayed: steps in its amax history
                out[side]["fp8_history_steps"] = trainer.fp8_scaling.updates
            del trainer
            _release(device)
    if args.hf:
        micro = args.hf_micro_batch or max(1, args.micro_batch_tokens // args.seq_len)
        out["hf"] = hf_train_steps(path, tokens, adv, args.response, micro, args.steps, device)
        out["hf"]["micro_batch"] = micro
    return out


def run(args: TrainBenchArgs) -> dict:
    """Runs both sides and returns the results (also printed, and written to --json-out)."""
    from milepost.models.registry import checkpoint_config
    from milepost.testing.dist import run_ranks

    config = checkpoint_config(args.model) if args.model is not None else shape_config(args.shape, args.layers)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and args.seq_len > limit:
        raise ValueError(f"--prompt + --response = {args.seq_len} exceeds the model's max_position_embeddings ({limit})")
    path = args.model or write_shape_checkpoint(args.shape, args.layers, args.device, args.seed)
    timeout = 600.0 + 60.0 * args.steps
    [res] = run_ranks(_rank, 1, str(path), args, config.vocab_size,
                      backend="nccl" if args.device == "cuda" else "gloo", timeout_s=timeout)
    flops = train_flops(config, args.samples, args.prompt, args.response)
    peak = device_peak(args)
    tokens = args.samples * args.seq_len
    report = {"model": str(args.model or args.shape), "layers": config.num_hidden_layers,
              "samples": args.samples, "prompt": args.prompt, "response": args.response,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "activation_checkpointing": args.activation_checkpointing, "compile_layers": args.compile_layers,
              "fused_kernels": args.fused_kernels, "precision": args.precision,
              "fp8_scaling": args.fp8_scaling,
              "micro_batch_tokens": args.micro_batch_tokens, "flops_per_step": flops}
    for side, r in res.items():
        step = statistics.median(r["step_times"])
        report[side] = {**r, "step_s": step, "tokens_per_s": tokens / step,
                        "mfu": flops / step / peak if peak else None}
    if "hf" in report and "milepost" in report:
        report["ratio"] = report["milepost"]["tokens_per_s"] / report["hf"]["tokens_per_s"]
    if "milepost_bf16" in report and "milepost" in report:
        report["precision_ratio"] = report["milepost"]["tokens_per_s"] / report["milepost_bf16"]["tokens_per_s"]
    if "megatron" in report and "milepost" in report:
        report["megatron_ratio"] = report["megatron"]["tokens_per_s"] / report["milepost"]["tokens_per_s"]
    return report


def _print(report: dict) -> None:
    print(f"{report['model']} ({report['layers']} layers) on {report['device']}: {report['samples']} x "
          f"({report['prompt']} + {report['response']}) tokens, micro-batch {report['micro_batch_tokens']} "
          f"tokens, activation checkpointing {report['activation_checkpointing']}"
          + (", compiled layers" if report["compile_layers"] else "")
          + ("" if report.get("fused_kernels", True) else ", fused kernels off"))
    for side in ("milepost", "milepost_bf16", "megatron", "hf"):
        if side not in report:
            continue
        r = report[side]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"  {side:13s} {r['tokens_per_s']:10.0f} tok/s  step {r['step_s']:.3f} s  MFU {mfu}  "
              f"peak {r['peak_gib']:.1f} GiB")
    if "ratio" in report:
        print(f"  ratio     {report['ratio']:.2f}x (milepost / Hugging Face loop, same run)")
    if "precision_ratio" in report:
        fmt = report["precision"] + (" delayed" if report.get("fp8_scaling") == "delayed" else "")
        print(f"  {fmt:13s} {report['precision_ratio']:.2f}x the bf16 trainer's tokens/s (same run)")
    if "megatron_ratio" in report:
        print(f"  megatron  {report['megatron_ratio']:.2f}x the FSDP backend's tokens/s (same run)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = run(args)
    except ValueError as err:
        print(f"milepost bench train: error: {err}", file=sys.stderr)
        return 2
    _print(report)
    if args.json_out is not None:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
