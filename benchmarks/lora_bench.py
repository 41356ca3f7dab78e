"""LoRA on the GPU (issue 21): the trainer with an adapter vs full training, and the engine
decoding with adapters vs none. Random weights, nothing downloaded; every variant in one run.

train : peak device memory and step time of one train step, full vs LoRA (rank 16, all seven
        projections) on the same batch; the weight update's payload (bytes) and the time to
        gather it on the trainer (`named_hf_weights`, what every transport sends).
decode: engine decode tokens/s, N requests x P prompt tokens, G new tokens (T=1, ignore_eos,
        CUDA graphs on): no adapter, every request on one adapter, and 4 adapters mixed in each
        batch (request i uses adapter i mod 4); the issue asks >= 70% of the no-adapter speed.
        Then the engine's side of an update: one adapter's tensors vs the whole base written in
        place (bytes, seconds).
Usage (H200):  python benchmarks/lora_bench.py train decode [--shape qwen3-4b] [--json out.jsonl]
Quick check of the machinery on CPU:  python benchmarks/lora_bench.py train decode --device cpu --shape tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096),
}
RANK, ALPHA = 16, 32.0


def train_bench(rank: int, world: int, path: str, device: str, dtype: str, samples: int, length: int,
                vocab: int) -> list[dict]:
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(0)
    items = [Sample(0, i, tokens=torch.randint(10, vocab, (length,), generator=g).tolist(),
                    response_length=length // 2) for i in range(samples)]
    batch = TrainBatch.from_samples(items, [torch.randn(length // 2, generator=g) for _ in items])
    rows = []
    for name, lora in (("full", {}), (f"lora r{RANK} all-linear", {"lora_rank": RANK, "lora_alpha": ALPHA})):
        s = TrainerSettings(lr=1e-6, global_batch_size=samples, max_tokens_per_micro_batch=8192,
                            device=device, dtype=dtype, **lora)
        backend = FSDPBackend.create(path, s)
        backend.train_step(batch)  # warm-up: the optimizer state exists from here on
        times = []
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            backend.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        payload = sum(t.numel() * t.element_size() for _, t in backend.named_hf_weights())
        if cuda:
            torch.cuda.synchronize()
        gather_s = time.perf_counter() - t0
        trainable = sum(p.numel() for p in backend.policy.parameters() if p.requires_grad)
        rows.append({"bench": "train", "variant": name, "step_s": min(times), "step_runs": times,
                     "peak_bytes": peak, "update_bytes": payload, "update_gather_s": gather_s,
                     "trainable_params": trainable})
        print(f"measured: {json.dumps(rows[-1])}", flush=True)
        del backend
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def random_adapters(pool, n: int, seed: int = 0) -> list[str]:
    """Load n random rank-RANK adapters on every projection the pool serves; their names."""
    from milepost.lora.settings import LoraSettings

    g = torch.Generator().manual_seed(seed)
    names = []
    for k in range(n):
        tensors = {}
        for key, a in pool.A.items():
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, a.shape[2], generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(pool.B[key].shape[0], RANK, generator=g) * 0.01
        pool.load_tensors(f"a{k}", LoraSettings(RANK, ALPHA, pool.target_modules), tensors)
        names.append(f"a{k}")
    return names


def timed(engine, prompts: list[list[int]], new: int, loras: list[str | None], tag: str) -> float:
    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams

    left, done = [len(prompts)], threading.Event()

    def on_output(out) -> None:
        if out.finished:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(Request(rid=f"{tag}{i}", prompt_ids=ids, on_output=on_output, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True),
                              lora_name=loras[i % len(loras)]))
    if not done.wait(600):
        raise RuntimeError(f"{tag}: generation did not finish")
    seconds = time.perf_counter() - t0
    engine.call(engine.flush_cache).result()
    return seconds


def decode_bench(a, path: Path, out: list[dict]) -> None:
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    n, p, g = a.requests, a.prompt_len, a.new_tokens
    cuda = a.device == "cuda"
    args = ServerArgs(model_path=path, device=a.device, dtype="bfloat16" if cuda else "float32",
                      max_running_requests=n, chunked_prefill_size=8192,
                      max_total_tokens=n * (p + g + 16), enable_lora=True, max_lora_rank=RANK,
                      max_loras_per_batch=4, disable_cuda_graph=not cuda).resolved()
    engine = build_engine(args)[0]
    engine.start()
    pool = engine.runner.lora
    names = random_adapters(pool, 4)
    vocab = SHAPES[a.shape]["vocab_size"]
    prompts = torch.randint(10, vocab, (n, p), generator=torch.Generator().manual_seed(1)).tolist()
    base = None
    for label, loras in (("none", [None]), ("1 adapter", names[:1]), ("4 adapters mixed", names)):
        timed(engine, prompts[:8], 4, loras, f"warm{label}")
        prefill = min(timed(engine, prompts, 1, loras, f"p{label}{i}") for i in range(2))
        full = min(timed(engine, prompts, g, loras, f"f{label}{i}") for i in range(2))
        decode = n * (g - 1) / (full - prefill)
        base = base or decode
        row = {"bench": "decode", "adapters": label, "requests": n, "prompt": p, "new": g,
               "kernel": pool.kernel, "graphs": bool(engine.runner.graphs and engine.runner.graphs.captured),
               "seconds": full, "decode_tokens_per_s": decode, "vs_none": decode / base}
        out.append(row)
        print(json.dumps(row), flush=True)
    out.append(apply_bench(engine, names[0]))
    print(json.dumps(out[-1]), flush=True)
    engine.close()


def apply_bench(engine, adapter: str) -> dict:
    """The engine's side of a weight update: write every tensor of one adapter, then of the whole
    base, in place through `weight_view` (what each transport ends in), on the engine thread."""
    model = engine.runner.model

    def write(names: list[str]) -> tuple[int, float]:
        views = [model.weight_view(n) for n in names]
        new = [torch.randn(v.shape, dtype=v.dtype, device=v.device) * 0.01 for v in views]

        def run() -> float:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                for v, t in zip(views, new):
                    v.copy_(t)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        return sum(t.numel() * t.element_size() for t in new), min(engine.call(run).result() for _ in range(3))

    everything = model.hf_weight_names()
    lora_bytes, lora_s = write([n for n in everything if n.startswith(f"{adapter}/")])
    base_bytes, base_s = write([n for n in everything if "/" not in n])
    return {"bench": "engine_apply", "adapter_bytes": lora_bytes, "adapter_s": lora_s,
            "base_bytes": base_bytes, "base_s": base_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("benches", nargs="+", choices=["train", "decode"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--samples", type=int, default=16, help="train: samples per step")
    ap.add_argument("--length", type=int, default=1024, help="train: tokens per sample (half response)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--json", default=None, help="append the rows to this JSONL file")
    a = ap.parse_args()
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        shape = SHAPES[a.shape]
        path = make_tiny_checkpoint(Path(d) / "m", "qwen3", with_tokenizer=False, **shape)
        if "train" in a.benches:
            [r] = run_ranks(train_bench, 1, str(path), a.device, dtype, a.samples, a.length,
                            shape["vocab_size"], backend="nccl" if a.device == "cuda" else "gloo",
                            timeout_s=580)
            rows += r
            full, lora = r
            print(f"{a.shape} {dtype} on {a.device}, {a.samples} x {a.length} tokens per step")
            for x in r:
                print(f"  {x['variant']:22} step {x['step_s']:.3f} s  peak {x['peak_bytes'] / 2**30:.2f} GiB  "
                      f"update {x['update_bytes'] / 2**20:.1f} MiB gathered in {x['update_gather_s']:.3f} s")
            if full["peak_bytes"]:
                print(f"  LoRA / full: step {lora['step_s'] / full['step_s']:.2f}x, "
                      f"peak {lora['peak_bytes'] / full['peak_bytes']:.2f}x, "
                      f"update bytes {lora['update_bytes'] / full['update_bytes']:.4f}x")
        if "decode" in a.benches:
            decode_bench(a, path, rows)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"shape": a.shape, "device": a.device, **r}) + "\n")


if __name__ == "__main__":
    main()
