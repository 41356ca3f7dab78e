"""Engine vs Hugging Face `generate`: same model, same prompts, same lengths, one run, one ratio.

Fixed shape: N requests of P random prompt tokens, G new tokens each (ignore_eos, greedy for
both). The model is a real architecture shape with random weights (no hub here). Prints tokens/s
of both and the ratio. `--shape qwen3-0.6b` is the Qwen3-0.6B shape; `tiny` runs anywhere.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=4096),
    "tiny": {},
}


def run_engine(model_dir: Path, prompts: list[list[int]], new: int, device: str, dtype: str,
               max_running: int) -> float:
    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    args = ServerArgs(model_path=model_dir, device=device, dtype=dtype,
                      max_running_requests=max_running, chunked_prefill_size=8192,
                      max_total_tokens=len(prompts) * (len(prompts[0]) + new + 16)).resolved()
    engine, _, _ = build_engine(args)
    engine.start()
    left = [len(prompts)]
    done = threading.Event()

    def on_output(out) -> None:
        if out.finished:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    def submit_all(tag: str, n_new: int) -> None:
        left[0] = len(prompts)
        done.clear()
        for i, ids in enumerate(prompts):
            engine.submit(Request(rid=f"{tag}{i}", prompt_ids=ids, on_output=on_output,
                                  params=SamplingParams(max_new_tokens=n_new, temperature=0,
                                                        ignore_eos=True),
                                  stop_ids=frozenset()))
        done.wait()

    submit_all("warm", 4)
    engine.call(engine.flush_cache).result()
    _sync(device)
    t0 = time.perf_counter()
    submit_all("run", new)
    _sync(device)
    seconds = time.perf_counter() - t0
    engine.close()
    return len(prompts) * new / seconds


def run_hf(model_dir: Path, prompts: list[list[int]], new: int, device: str, dtype: str,
           batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    ids = torch.tensor(prompts, device=device)

    def go(n: int) -> None:
        for s in range(0, len(prompts), batch):
            model.generate(ids[s:s + batch], max_new_tokens=n, min_new_tokens=n, do_sample=False)

    go(4)
    _sync(device)
    t0 = time.perf_counter()
    go(new)
    _sync(device)
    return len(prompts) * new / (time.perf_counter() - t0)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    a = p.parse_args()

    from milepost.testing.checkpoints import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp), "qwen3", **SHAPES[a.shape])
        vocab = SHAPES[a.shape].get("vocab_size", 512)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, vocab, (a.requests, a.prompt_len), generator=g).tolist()
        ours = run_engine(model_dir, prompts, a.new_tokens, a.device, a.dtype, a.requests)
        hf = run_hf(model_dir, prompts, a.new_tokens, a.device, a.dtype, a.requests)
    print(f"shape={a.shape} device={a.device} dtype={a.dtype} requests={a.requests} "
          f"prompt={a.prompt_len} new={a.new_tokens}")
    print(f"milepost: {ours:10.1f} tok/s   transformers generate: {hf:10.1f} tok/s   "
          f"ratio: {ours / hf:.2f}x")


if __name__ == "__main__":
    main()
