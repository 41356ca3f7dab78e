"""The engine's GPU paths at real shapes (random weights built on the GPU; nothing is downloaded).

decode : issue 4 benchmark (a): N requests x P random prompt tokens, G new tokens, ignore_eos,
         temperature 1. Prints tokens/s, decode-only tokens/s (a run with 1 new token subtracted),
         and the fraction of the decode memory-bandwidth bound: (weight bytes + KV bytes read per
         step) over the copy bandwidth measured in the same run.
hf     : transformers `generate` on the same shape and lengths (static batch, sampling, T=1).
prefill: N x 1024-token prompts, 1 new token: prompt tokens/s.
moe    : Qwen3-30B-A3B shape, benchmark (a) shape, routed-expert recording on vs off.
Usage: python benchmarks/engine_gpu.py decode hf prefill moe [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=False,
                     rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[])


def hf_config(kind: str):
    import transformers

    if kind == "moe":
        cfg = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = transformers.Qwen3Config(**QWEN3_06B)
        cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def random_model(cfg, model_dir: Path):
    """Our model for `cfg`, allocated on the GPU and filled in place (norms 1, the rest N(0, .02))."""
    from milepost.models.registry import build_model

    cfg.save_pretrained(model_dir)  # config.json only: ServerArgs validates the directory
    model = build_model(cfg, torch.bfloat16, "cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def make_engine(model, model_dir: Path, n: int, tokens: int, chunk: int, record: bool = True):
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    args = ServerArgs(model_path=model_dir, device="cuda", dtype="bfloat16",
                      max_running_requests=n, chunked_prefill_size=chunk,
                      max_total_tokens=tokens).resolved()
    t0 = time.perf_counter()
    engine = build_engine(args, model=model, record_routed_experts=record)[0]
    engine.start()
    return engine, time.perf_counter() - t0


def timed_run(engine, prompts: list[list[int]], new: int, tag: str) -> float:
    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams

    left = [len(prompts)]
    done = threading.Event()

    def on_output(out) -> None:
        if out.finished:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(Request(rid=f"{tag}{i}", prompt_ids=ids, on_output=on_output,
                              params=SamplingParams(max_new_tokens=new, temperature=1.0,
                                                    ignore_eos=True),
                              stop_ids=frozenset()))
    if not done.wait(600):
        raise RuntimeError(f"{tag}: generation did not finish")
    seconds = time.perf_counter() - t0
    engine.call(engine.flush_cache).result()
    return seconds


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 4 GiB device-to-device copy (median of 10)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * (2 << 30) / sorted(times[2:])[5]


def prompts_of(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def bench_decode(a, tmp: Path, out: list[dict]) -> None:
    cfg = hf_config("dense")
    model = random_model(cfg, tmp)
    n, p, g = a.requests, a.prompt_len, a.new_tokens
    engine, setup_s = make_engine(model, tmp, n, n * (p + g + 16), 8192)
    prompts = prompts_of(n, p, cfg.vocab_size)
    timed_run(engine, prompts[:8], 4, "warm")
    t_prefill = min(timed_run(engine, prompts, 1, f"p{i}_") for i in range(2))
    t_full = [timed_run(engine, prompts, g, f"f{i}_") for i in range(2)]
    engine.close()
    full = min(t_full)
    bw = copy_bandwidth()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    mean_ctx = p + (g + 1) / 2
    step_bytes = weight_bytes + n * mean_ctx * kv_per_token
    bound = n / (step_bytes / bw)
    decode = n * (g - 1) / (full - t_prefill)
    row = dict(bench="decode_a", requests=n, prompt=p, new=g, seconds=full, runs=t_full,
               tokens_per_s=n * g / full, decode_tokens_per_s=decode, bound_tokens_per_s=bound,
               fraction_of_bound=decode / bound, copy_bw_GBps=bw / 1e9, setup_s=setup_s,
               weight_GB=weight_bytes / 1e9)
    out.append(row)
    print(json.dumps(row), flush=True)
    del engine, model
    torch.cuda.empty_cache()


def bench_prefill(a, tmp: Path, out: list[dict]) -> None:
    cfg = hf_config("dense")
    model = random_model(cfg, tmp)
    n, p = a.requests, 1024
    engine, _ = make_engine(model, tmp, n, n * (p + 32), a.prefill_chunk)
    rows = []
    for sdpa in (False, True):
        engine.runner.attention.sdpa_for_fresh_prefill = sdpa
        rows.append(_prefill_runs(engine, n, p, cfg.vocab_size, sdpa, a.prefill_chunk))
    engine.close()
    for row in rows:
        out.append(row)
        print(json.dumps(row), flush=True)
    del engine, model
    torch.cuda.empty_cache()


def _prefill_runs(engine, n: int, p: int, vocab: int, sdpa: bool, chunk: int) -> dict:
    prompts = prompts_of(n, p, vocab, seed=1)
    timed_run(engine, prompts[:8], 2, f"warm{sdpa}")
    times = [timed_run(engine, prompts, 1, f"p{i}_{sdpa}") for i in range(3)]
    return dict(bench="prefill", attention="sdpa (fresh prompts)" if sdpa else "paged triton kernel",
                requests=n, prompt=p, chunk=chunk, runs=times, tokens_per_s=n * p / min(times))


def bench_hf(a, tmp: Path, out: list[dict]) -> None:
    from transformers import AutoModelForCausalLM

    cfg = hf_config("dense")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    n, p, g = a.requests, a.prompt_len, a.new_tokens
    ids = torch.tensor(prompts_of(n, p, cfg.vocab_size), device="cuda")

    def go(new: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    go(4)
    seconds = go(g)
    row = dict(bench="hf_generate_a", requests=n, prompt=p, new=g, seconds=seconds,
               tokens_per_s=n * g / seconds)
    out.append(row)
    print(json.dumps(row), flush=True)
    del model
    torch.cuda.empty_cache()


def bench_moe(a, tmp: Path, out: list[dict]) -> None:
    cfg = hf_config("moe")
    t0 = time.perf_counter()
    model = random_model(cfg, tmp)
    init_s = time.perf_counter() - t0
    n, p, g = a.requests, a.prompt_len, a.moe_new_tokens
    prompts = prompts_of(n, p, cfg.vocab_size, seed=2)
    res = {}
    for record in (True, False, True):  # on, off, on again: the spread shows the noise
        engine, setup_s = make_engine(model, tmp, n, n * (p + g + 16), 8192, record=record)
        timed_run(engine, prompts[:8], 4, "warm")
        seconds = timed_run(engine, prompts, g, "m")
        engine.close()
        del engine
        torch.cuda.empty_cache()
        res.setdefault(record, []).append(n * g / seconds)
        print(f"moe record={record}: {n * g / seconds:.0f} tok/s (setup {setup_s:.1f} s)", flush=True)
    on, off = max(res[True]), res[False][0]
    row = dict(bench="moe_a", requests=n, prompt=p, new=g, record_on_tokens_per_s=res[True],
               record_off_tokens_per_s=off, recording_cost=1 - on / off, init_s=init_s)
    out.append(row)
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="+", choices=["decode", "hf", "prefill", "moe"])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--moe-new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    out: list[dict] = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    benches = dict(decode=bench_decode, hf=bench_hf, prefill=bench_prefill, moe=bench_moe)
    for what in a.what:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                benches[what](a, Path(tmp), out)
            except Exception as e:  # keep the other benchmarks' numbers; report this one's error
                print(f"{what} FAILED: {e!r}", flush=True)
                import traceback

                traceback.print_exc()
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text("".join(json.dumps(r) + "\n" for r in out))
    dec = next((r for r in out if r["bench"] == "decode_a"), None)
    hf = next((r for r in out if r["bench"] == "hf_generate_a"), None)
    if dec and hf:
        print(f"benchmark (a): milepost {dec['tokens_per_s']:.0f} tok/s vs transformers generate "
              f"{hf['tokens_per_s']:.0f} tok/s: {dec['tokens_per_s'] / hf['tokens_per_s']:.1f}x")


if __name__ == "__main__":
    main()
