"""The transformers fallback's engine speed against the native path and transformers `generate`.

One random checkpoint (Qwen2 or Mistral shape, saved once), served in-process three ways on the
same requests: milepost's engine with native model code, the same engine with
`--model-impl transformers`, and transformers `generate` in one static batch. Prints output
tokens/s of each and the ratios. Example (CPU):
    python benchmarks/fallback_speed.py --layers 4 --hidden 256 --requests 8 --output-len 32
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine


def make_checkpoint(path: Path, arch: str, layers: int, hidden: int, heads: int, vocab: int) -> Path:
    cls, model = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "mistral": ("MistralConfig", "MistralForCausalLM")}[arch]
    config = getattr(transformers, cls)(
        hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=vocab,
        max_position_embeddings=4096, sliding_window=None, tie_word_embeddings=False)
    config.architectures = [model]
    getattr(transformers, model)(config).save_pretrained(path)
    return path


def engine_tok_s(path: Path, impl: str, device: str, dtype: str, prompts: list[list[int]], n: int) -> float:
    args = ServerArgs(model_path=path, device=device, dtype=dtype, model_impl=impl,
                      max_running_requests=len(prompts), max_total_tokens=len(prompts) * 1024).resolved()
    engine = build_engine(args)[0]
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=f"r{i}", prompt_ids=p, stop_ids=frozenset(), on_output=lambda o: None,
                              params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)))
    engine._drain_inbox(block=False)
    _sync(device)
    start = time.perf_counter()
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    _sync(device)
    return len(prompts) * n / (time.perf_counter() - start)


@torch.no_grad()
def generate_tok_s(path: Path, device: str, dtype: str, prompts: list[list[int]], n: int) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    cfg = transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=0, eos_token_id=None)
    _sync(device)
    start = time.perf_counter()
    hf.generate(ids, generation_config=cfg)
    _sync(device)
    return len(prompts) * n / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["qwen2", "mistral"], default="qwen2")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    a = p.parse_args()
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, a.vocab, (a.requests, a.prompt_len), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), a.arch, a.layers, a.hidden, a.heads, a.vocab)
        results = {
            "native": engine_tok_s(path, "native", a.device, dtype, prompts, a.output_len),
            "fallback": engine_tok_s(path, "transformers", a.device, dtype, prompts, a.output_len),
            "generate": generate_tok_s(path, a.device, dtype, prompts, a.output_len),
        }
    print(f"{a.arch} {a.layers}x{a.hidden}, {a.requests} requests x {a.prompt_len}+{a.output_len} tokens, "
          f"{a.device} {dtype}")
    for k, v in results.items():
        print(f"  {k:9} {v:9.1f} output tok/s")
    print(f"  fallback / native = {results['fallback'] / results['native']:.2f}x, "
          f"fallback / generate = {results['fallback'] / results['generate']:.2f}x")


if __name__ == "__main__":
    main()
