"""`milepost bench engine`: the embedded engine against transformers `generate`, one run, ratios.

Same model (same weights), same requests, same lengths on both sides; the engine runs
in-process (`Engine`, no HTTP) so the numbers are the engine's. Per scenario it reports tokens/s
of both and their ratio; for decode, the fraction of the memory-bandwidth bound reached:
(bytes of weights + KV read by the decode steps) / (their measured time) / peak bandwidth, and
the same bytes a second against a device-to-device copy timed in the same run (copy_bandwidth.py).
"""

from __future__ import annotations

import gc
import json
import logging
import sys
from dataclasses import asdict

import torch

from milepost.bench import workloads
from milepost.bench.args import PEAK_BANDWIDTH, BenchArgs
from milepost.bench.copy_bandwidth import copy_bandwidth
from milepost.bench.engine_side import EngineBench, EngineResult
from milepost.bench.hf_side import run_hf
from milepost.bench.models import (
    hf_copy,
    human,
    kv_bytes_per_token,
    native_model,
    parameter_count,
    weight_bytes_per_decode_step,
)
from milepost.bench.stalls import StallWatch, format_stalls, summarize_stalls
from milepost.bench.timeline import format_summary
from milepost.engine.kernel_warmup import start_engine
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine

log = logging.getLogger(__name__)


def run_bench(args: BenchArgs) -> dict:
    """Run every scenario of `args` on both sides; the results as a JSON-ready dict."""
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, args.dtype if args.dtype != "auto" else
                    ("bfloat16" if device.type == "cuda" else "float32"))
    copy_bw = copy_bandwidth(device)  # before the model and the KV pool take the memory
    native, config_dir = native_model(args.model, args.shape, dtype, device, args.seed)
    vocab = native.vocab_size
    context = native.hf_config.max_position_embeddings
    loads = _workloads(args, vocab)
    for w in loads:
        if workloads.longest_sequence(w) > context:
            raise ValueError(f"scenario {w.name}: a request reaches {workloads.longest_sequence(w)} "
                             f"tokens, beyond the model's context {context}; shorten its lengths")
    sargs = ServerArgs(
        model_path=config_dir, device=device.type, dtype=str(dtype).removeprefix("torch."),
        max_running_requests=args.max_running_requests or max(len(w.output_lens) for w in loads),
        chunked_prefill_size=args.chunked_prefill_size, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static, random_seed=args.seed,
        page_size=args.page_size, overlap_schedule=args.overlap_schedule,
        sampling_backend=args.sampling_backend, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        skip_kernel_warmup=args.skip_kernel_warmup, fp8_w8a8_experts=args.fp8_w8a8_experts,
        decode_gemm=args.decode_gemm,
    ).resolved()
    weights_per_step: dict[int, float] = {}  # decode batch size -> weight bytes one step reads
    kv_token_bytes = kv_bytes_per_token(native, torch.float8_e4m3fn if sargs.kv_cache_dtype == "fp8_e4m3"
                                        else getattr(torch, sargs.kv_cache_dtype))
    ours, pool_tokens = _engine_runs(sargs, native, loads, args, record_routed_experts=True)
    decode_bytes = {name: _decode_bytes(r, native, kv_token_bytes, weights_per_step)
                    for name, r in ours.items()}
    spec_runs: dict[str, dict[str, EngineResult]] = {}  # scope (ngram) or "" -> scenario -> result
    for scope in _spec_scopes(args):  # the same scenarios again, speculating, in this run
        spec_runs[scope], _ = _engine_runs(_speculative_args(sargs, args, scope), native,
                                           _workloads(args, vocab), args, record_routed_experts=True)
    unrecorded = None
    if args.routed_experts_cost and native.moe_top_k > 0:
        again = _workloads(args, vocab)[:1]  # fresh: multiturn prompts are filled in as it runs
        unrecorded = _engine_runs(sargs, native, again, args, record_routed_experts=False)[0]
    theirs = {}
    if args.hf:
        hf = hf_copy(native, dtype, device)
        run_hf(hf, workloads.fixed(min(8, args.requests), 32, 8, vocab, args.seed + 99),
               None, args.temperature, device)  # warm-up
        for w in loads:
            theirs[w.name] = r = run_hf(hf, w, args.hf_batch_size, args.temperature, device)
            _progress(f"transformers {w.name}: {r.output_tokens} new tokens in {r.seconds:.1f} s")
    peak = args.peak_bandwidth or _known_peak(device)
    rows = [_row(w, ours[w.name], theirs.get(w.name), decode_bytes[w.name], peak) for w in loads]
    for row in rows:
        if row.get("decode_bytes_per_s"):
            row["copy_bandwidth_fraction"] = row["decode_bytes_per_s"] / copy_bw
    for row, w in zip(rows, loads):
        by_scope = [_speculative_row(args.speculative or "", scope, row, spec[w.name])
                    for scope, spec in spec_runs.items()]
        if by_scope:  # the first scope's as before; every scope's under speculative_by_scope
            row["speculative"] = by_scope[0]
            if len(by_scope) > 1:
                row["speculative_by_scope"] = by_scope
    if unrecorded is not None:
        name, off = next(iter(unrecorded.items()))
        off_row = _row(loads[0], off, None, _decode_bytes(off, native, kv_token_bytes,
                                                         weights_per_step), peak)
        off_row["scenario"] = f"{name} (routed experts not recorded)"
        rows[0]["routed_experts_cost"] = 1.0 - rows[0]["milepost_tok_s"] / off_row["milepost_tok_s"]
        rows.insert(1, off_row)
    return {
        "model": str(args.model or args.shape), "parameters": parameter_count(native),
        "device": _device_name(device), "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": sargs.kv_cache_dtype, "kv_pool_tokens": pool_tokens, "decode_gemm": sargs.decode_gemm,
        "peak_bandwidth": peak, "copy_bandwidth": copy_bw, "torch": torch.__version__,
        "scenarios": rows,
    }


def _engine_runs(sargs: ServerArgs, native: object, loads: list[workloads.Workload],
                 args: BenchArgs, record_routed_experts: bool,
                 ) -> tuple[dict[str, EngineResult], int]:
    """One engine over `native`: a warm-up, then each workload; the engine is freed after."""
    engine, _, _ = build_engine(sargs, model=native, record_routed_experts=record_routed_experts)
    start_engine(engine, kernel_warmup=not sargs.skip_kernel_warmup)
    watch = StallWatch().start()  # compiles and full collections inside each timed run
    try:
        bench = EngineBench(engine, args.temperature, timeline=args.timeline)
        # Warm-up: the same shapes with other tokens (so nothing it caches is hit later). Triton
        # kernels compile per shape class and the allocator grows on first use; a small warm-up
        # left that inside the first timed workload (24.9k vs 41.2k tok/s on the H200).
        for w in _workloads(args, native.vocab_size, args.seed + 99):
            bench.run(w)
        results = {}
        for w in loads:
            before, mark = _spec_counters(engine), len(watch.events)
            results[w.name] = r = bench.run(w)
            r.speculative = _spec_delta(before, _spec_counters(engine))
            r.stalls = summarize_stalls(watch.since(mark))
            for line in format_stalls(f"milepost {w.name}", r.stalls):
                _progress(line)
            _progress(f"milepost {w.name}: {r.output_tokens} new tokens in {r.seconds:.1f} s"
                      + (f", acceptance length {r.speculative['accept_length']:.2f}"
                         if r.speculative else ""))
        pool_tokens = engine.cfg.num_blocks * engine.cfg.block_size
    finally:
        watch.stop()
        engine.close()
    del engine
    gc.collect()  # the KV pool (and CUDA graphs) go before the next engine or transformers
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results, pool_tokens


def _spec_scopes(args: BenchArgs) -> list[str]:
    """One speculative run per n-gram scope (ngram), or one run ("") for the other drafts."""
    if not args.speculative:
        return []
    return args.speculative_ngram_scope.split(",") if args.speculative == "ngram" else [""]


def _speculative_args(sargs: ServerArgs, args: BenchArgs, scope: str = "") -> ServerArgs:
    """The engine settings of the speculative run: the plain run's, plus the algorithm (the
    overlap schedule is off there, proposals need each step's tokens on the host, except under
    NGRAM, which runs the steps it rests overlapped)."""
    spec = args.speculative or ""
    algo = {"ngram": "NGRAM", "nextn": "NEXTN"}.get(spec, "STANDALONE")
    extra = {"speculative_algorithm": algo,
             "speculative_num_draft_tokens": args.speculative_num_draft_tokens}
    if algo != "NGRAM":
        extra["overlap_schedule"] = "off"
    else:
        extra["speculative_ngram_measured_rest"] = args.speculative_ngram_measured_rest
    if scope:
        extra["speculative_ngram_scope"] = scope
    if spec.startswith("draft:"):
        extra["speculative_draft_model_path"] = spec.removeprefix("draft:")
    fields = sargs.model_dump(exclude_unset=False) | extra
    return ServerArgs(**fields).resolved()


def _speculative_row(name: str, scope: str, plain: dict, spec: EngineResult) -> dict:
    counted = spec.prompt_tokens if plain["counted_tokens"] == "prompt" else spec.output_tokens
    tok_s = counted / spec.seconds
    s = spec.speculative or {}
    return {"algorithm": name + (f" ({scope} scope)" if scope else ""), "tok_s": tok_s,
            "seconds": spec.seconds,
            "speedup": tok_s / plain["milepost_tok_s"], **s}


def _workloads(args: BenchArgs, vocab: int, seed: int | None = None) -> list[workloads.Workload]:
    seed = args.seed if seed is None else seed
    make = {
        "fixed": lambda: workloads.fixed(args.requests, args.prompt_len, args.output_len, vocab,
                                         seed, args.n_samples_per_prompt),
        "mixed": lambda: workloads.mixed(args.requests, args.mixed_min, args.mixed_max, vocab,
                                         seed),
        "multiturn": lambda: workloads.multiturn(args.sessions, args.turns, args.prompt_len,
                                                 args.turn_user_len, args.turn_output_len, vocab,
                                                 seed, args.group_size),
        "prefill": lambda: workloads.prefill(args.prefill_requests, args.prefill_len, vocab,
                                             seed),
    }
    return [make[name]() for name in args.scenario_list]


def _spec_counters(engine: object) -> tuple[int, ...] | None:
    spec = getattr(engine, "speculator", None)
    if spec is None:
        return None
    s = engine.call(lambda: (spec.stats.verify_rows, spec.stats.proposed, spec.stats.accepted,
                             engine.runner.verify_replays, spec.stats.rested_steps,
                             spec.pace.slower_rests))
    return s.result()


def _spec_delta(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> dict | None:
    """Acceptance over one workload: tokens per verified request-step (1 + accepted proposals),
    the engine steps whose verify the decode CUDA graphs replayed, and NGRAM's rested steps (and
    rests begun because speculating measured slower, speculative_pace.py)."""
    if before is None or after is None:
        return None
    rows, proposed, accepted, replays, rested, slower = (a - b for a, b in zip(after, before))
    return {"verify_steps": rows, "graph_verify_steps": replays, "proposed": proposed, "accepted": accepted,
            "rested_steps": rested, "slower_rests": slower,
            "accept_length": (rows + accepted) / rows if rows else 0.0,
            "accept_rate": accepted / proposed if proposed else 0.0}


def _decode_bytes(r: EngineResult, native: object, kv_token_bytes: int, cache: dict) -> float:
    """Bytes the decode steps of a run read: weights per step (by batch size) + KV attended."""
    weights = 0.0
    for batch, steps in r.decode_batch_sizes.items():
        if batch not in cache:
            cache[batch] = weight_bytes_per_decode_step(native, batch)
        weights += cache[batch] * steps
    return weights + r.decode_kv_tokens * kv_token_bytes


def _row(w: workloads.Workload, ours: EngineResult, theirs: object | None, decode_bytes: float,
         peak: float | None) -> dict:
    counted = "prompt" if w.name == "prefill" else "output"  # prefill is measured in prompt tokens
    tokens = ours.prompt_tokens if counted == "prompt" else ours.output_tokens
    row: dict = {"scenario": w.name, "requests": len(w.output_lens), "counted_tokens": counted,
                 "tokens": tokens, "milepost_seconds": ours.seconds,
                 "milepost_tok_s": tokens / ours.seconds,
                 "prompt_tokens": ours.prompt_tokens, "output_tokens": ours.output_tokens,
                 "milepost_prefill_tok_s": None, "hf_tok_s": None, "ratio": None}
    if counted == "prompt":
        row["milepost_prefill_tok_s"] = row["milepost_tok_s"]
    if ours.timeline is not None:
        row["timeline"] = ours.timeline
    if ours.stalls is not None:
        row["stalls"] = ours.stalls
    if theirs is not None:
        hf_tokens = theirs.prompt_tokens if counted == "prompt" else theirs.output_tokens
        row.update(hf_seconds=theirs.seconds, hf_tok_s=hf_tokens / theirs.seconds)
        row["ratio"] = row["milepost_tok_s"] / row["hf_tok_s"]
    if w.turns > 1:
        row["prefix_cache_hit_rate"] = ours.cached_tokens / max(ours.prompt_tokens, 1)
        row["prefix_cache_hit_rate_later_turns"] = (
            ours.later_turn_cached_tokens / max(ours.later_turn_prompt_tokens, 1))
    if ours.decode_steps:
        row["decode_steps"] = ours.decode_steps
        row["decode_step_ms"] = 1e3 * ours.decode_seconds / ours.decode_steps
        row["decode_tok_s"] = sum(b * n for b, n in ours.decode_batch_sizes.items()) / ours.decode_seconds
        row["decode_bytes_per_s"] = decode_bytes / ours.decode_seconds
        row["bandwidth_fraction"] = row["decode_bytes_per_s"] / peak if peak else None
        if peak:  # the decode tokens/s that reading those bytes at peak bandwidth would allow
            row["decode_bound_tok_s"] = row["decode_tok_s"] / row["bandwidth_fraction"]
    return row


def _progress(line: str) -> None:
    """Long runs (full-size mixed workloads take minutes) say where they are, on stderr."""
    print(line, file=sys.stderr, flush=True)


def _known_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_table(result: dict) -> None:
    """The results as a rich table (one row per scenario)."""
    from rich.console import Console
    from rich.table import Table

    def fmt(v: float | None, spec: str = ",.0f") -> str:
        if v is not None and spec == ",.0f" and abs(v) < 100:
            spec = ".3g"  # small rates (CPU runs) keep their digits
        return "-" if v is None else format(v, spec)

    title = (f"milepost bench engine: {result['model']} ({human(result['parameters'])} params), "
             f"{result['device']}, {result['dtype']} (KV {result['kv_cache_dtype']})")
    table = Table(title=title)
    for col in ("scenario", "requests", "tokens", "milepost tok/s", "transformers tok/s", "ratio",
                "prefix hit", "decode step", "decode tok/s", "of bandwidth bound"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    notes: list[str] = []
    for r in result["scenarios"]:
        hit = r.get("prefix_cache_hit_rate")
        table.add_row(
            r["scenario"] + (" (prompt tok)" if r["counted_tokens"] == "prompt" else ""),
            str(r["requests"]), f"{r['tokens']:,}", fmt(r["milepost_tok_s"]), fmt(r["hf_tok_s"]),
            fmt(r["ratio"], ".2f") + ("x" if r["ratio"] is not None else ""),
            "-" if hit is None else f"{hit:.1%} ({r['prefix_cache_hit_rate_later_turns']:.1%} t>1)",
            fmt(r.get("decode_step_ms"), ".2f") + (" ms" if r.get("decode_step_ms") else ""),
            fmt(r.get("decode_tok_s")),
            "-" if r.get("bandwidth_fraction") is None else f"{r['bandwidth_fraction']:.1%}",
        )
        for spec in r.get("speculative_by_scope") or ([r["speculative"]] if r.get("speculative") else []):
            notes.append(f"{r['scenario']} with speculative {spec['algorithm']}: "
                         f"{fmt(spec['tok_s'])} tok/s, {spec['speedup']:.2f}x the plain run; "
                         f"acceptance length {spec.get('accept_length', 0):.2f} "
                         f"(rate {spec.get('accept_rate', 0):.1%} of "
                         f"{spec.get('proposed', 0):,} proposed; "
                         f"{spec.get('graph_verify_steps', 0):,} verify steps in CUDA graphs; "
                         f"{spec.get('rested_steps', 0):,} steps rested, "
                         f"{spec.get('slower_rests', 0):,} rests for measuring slower)")
        if r.get("timeline"):
            notes.extend(format_summary(r["scenario"], r["timeline"]))
        if r.get("stalls"):
            notes.extend(format_stalls(r["scenario"], r["stalls"]))
        if "routed_experts_cost" in r:
            notes.append(f"recording routed experts costs {r['routed_experts_cost']:.1%} of "
                         f"{r['scenario']} throughput (measured against the run without it)")
    console = Console(width=None if Console().is_terminal else 160)  # files and pipes: no wrapping
    console.print(table)
    for note in notes:
        console.print(note)
    if result["peak_bandwidth"] is None:
        console.print("bandwidth bound: no peak known for this device (pass --peak-bandwidth)")
    decoding = [r for r in result["scenarios"] if r.get("copy_bandwidth_fraction")]
    if decoding:
        console.print(f"a {result['device']} memory copy in this run: {result['copy_bandwidth'] / 1e12:.2f} "
                      f"TB/s (read + write); decode reads at " + ", ".join(
                          f"{r['copy_bandwidth_fraction']:.1%} of it ({r['scenario']})"
                          for r in decoding))


def main(args: BenchArgs) -> int:
    result = run_bench(args)
    print_table(result)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2, default=_jsonable))
    return 0


def _jsonable(v: object) -> object:
    return asdict(v) if hasattr(v, "__dataclass_fields__") else str(v)
