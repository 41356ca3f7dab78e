"""Speculative decoding on the tiny demo's RL'd model: acceptance, speed and reward, one process.

    python benchmarks/speculative_demo.py --model RL_HF_DIR --draft BASE_DIR --prompts eval_prompts.jsonl \
        [--device cuda]

The demo's eval prompts ("23+45="), 8 samples each as a GRPO group would draw them, at
temperature 1 with the real stop token, through the in-process engine: plain, NGRAM, STANDALONE
with the pre-RL base model as draft, and STANDALONE with the model itself as draft (the upper
bound). Prints per mode: seconds, output tokens/s, the ratio to plain, acceptance length and the
exact-answer rate (the reward), which must agree across modes within sampling noise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine


def run(model: Path, prompts: list[dict], samples: int, tokenizer: object, device: str,
        warmup: list[dict], **flags: object) -> dict:
    args = ServerArgs(model_path=model, device=device, dtype="float32", max_total_tokens=65536,
                      max_running_requests=512, random_seed=1, **flags).resolved()
    engine, info, _ = build_engine(args)
    stop = frozenset(info.eos_token_ids)
    try:
        if warmup:  # other prompts first: kernels compile and the allocator grows outside the timing
            _generate(engine, warmup, samples, tokenizer, stop)
        if engine.speculator is not None:
            engine.speculator.stats = type(engine.speculator.stats)()
        return _generate(engine, prompts, samples, tokenizer, stop)
    finally:
        engine.close()


def _generate(engine: object, prompts: list[dict], samples: int, tokenizer: object,
              stop: frozenset[int]) -> dict:
    done: dict[str, list[int]] = {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, rec in enumerate(prompts):
        ids = tokenizer.encode(rec["prompt"], add_special_tokens=False)
        for s in range(samples):
            rid = f"{i}-{s}"
            engine.submit(Request(
                rid=rid, prompt_ids=ids, stop_ids=stop,
                params=SamplingParams(max_new_tokens=8, temperature=1.0),
                on_output=lambda o, rid=rid: done.setdefault(rid, []).extend(o.new_token_ids)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    seconds = time.perf_counter() - t0
    tokens = sum(len(v) for v in done.values())
    right = sum(tokenizer.decode([t for t in done[f"{i}-{s}"] if t not in stop]).strip() == rec["label"]
                for i, rec in enumerate(prompts) for s in range(samples))
    out = {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
           "reward": right / (len(prompts) * samples)}
    if engine.speculator is not None:
        st = engine.speculator.stats
        out |= {"accept_length": st.accept_length, "accepted": st.accepted, "proposed": st.proposed}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--n-prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: decode CUDA graphs on (verify steps replayed in them), and a "
                         "warm-up on the next --n-prompts prompts before each timed run")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    every = [json.loads(line) for line in a.prompts.read_text().splitlines()]
    prompts = every[: a.n_prompts]
    warmup = every[a.n_prompts : 2 * a.n_prompts] if a.device == "cuda" else []
    modes = {
        "plain": {},
        "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1},
        "STANDALONE, base model draft": {"speculative_algorithm": "STANDALONE",
                                         "speculative_draft_model_path": a.draft},
        "STANDALONE, the model itself": {"speculative_algorithm": "STANDALONE",
                                         "speculative_draft_model_path": a.model},
        # once more: a first engine in the process may pay for something its warm-up missed
        # (on an H100 the first plain run took 10x the speculative runs' time: 2.0 s)
        "plain, again": {},
    }
    results = {}
    for name, flags in modes.items():
        results[name] = r = run(a.model, prompts, a.samples, tok, a.device, warmup, **flags)
        base = results["plain"]["tok_s"]
        print(f"{name:30s} {r['seconds']:6.1f} s {r['tok_s']:8.1f} tok/s {r['tok_s'] / base:5.2f}x "
              f"reward {r['reward']:.3f} acceptance length {r.get('accept_length', 1.0):.2f} "
              f"({r.get('accepted', 0)}/{r.get('proposed', 0)})", flush=True)


if __name__ == "__main__":
    main()
