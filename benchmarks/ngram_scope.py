"""N-gram speculation by scope on real RL prompts: the demo model, n samples per prompt (GRPO).

`python benchmarks/ngram_scope.py DEMO_DIR [--prompts 16 --n 8 --temperature 1.0 --rounds 2]
[--model RUN_DIR/hf] [--device cuda]`
runs the same requests (the demo's rl_prompts.jsonl, each sampled n times at once, stopping at
EOS as rollouts do) through a plain engine and through NGRAM engines of scope request, prompt and
engine, in one process, and prints tokens/s, speed-up and acceptance length (over all rounds, the
warm-up included, and by timed round). Round 1 is a rollout's first sight of its prompts: a GRPO
group's samples decode in step, so a sibling is rarely ahead with text to offer. Round r > 1 sends
the same prompts again (a later epoch) to the same engine: what the shared store can reuse.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine


def run(model: Path, prompts: list[list[int]], n: int, temperature: float, rounds: int,
        eos: int, scope: str | None, max_new: int, device: str = "cpu") -> dict:
    flags = {"speculative_algorithm": "NGRAM", "speculative_ngram_scope": scope} if scope else {}
    engine = build_engine(ServerArgs(model_path=model, device=device, dtype="float32",
                                     max_running_requests=len(prompts) * n, **flags).resolved())[0]
    engine.start()
    per_round = []
    try:
        for r in range(rounds + 1):  # round 0: warm-up on other prompts
            batch = prompts[len(prompts) // 2:] if r == 0 else prompts[: len(prompts) // 2]
            left, done, count = [len(batch) * n], threading.Event(), [0]
            lock = threading.Lock()

            def on_output(out: RequestOutput) -> None:
                with lock:
                    count[0] += len(out.new_token_ids)
                    if out.finished:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()

            before = _counts(engine)
            t0 = time.perf_counter()
            for i, p in enumerate(batch):
                for j in range(n):
                    engine.submit(Request(rid=f"{r}-{i}-{j}", prompt_ids=p, on_output=on_output,
                                          stop_ids=frozenset({eos}),
                                          params=SamplingParams(max_new_tokens=max_new,
                                                                temperature=temperature,
                                                                sampling_seed=r * 100_000 + i * n + j)))
            done.wait()
            seconds = time.perf_counter() - t0
            assert engine.call(engine.flush_cache).result()
            if r:
                after = _counts(engine)
                rows, accepted = after[0] - before[0], after[1] - before[1]
                per_round.append({"tokens": count[0], "seconds": seconds,
                                  "accept_length": (rows + accepted) / rows if rows else None})
        stats = engine.speculator.stats if engine.speculator else None
        spec = ({"accept_length": stats.accept_length, "accept_rate": stats.accept_rate,
                 "proposed": stats.proposed} if stats else {})
    finally:
        engine.close()
    return {"rounds": per_round, **spec}


def _counts(engine: object) -> tuple[int, int]:
    """(verified request-steps, accepted proposals) so far: a round's acceptance is the change."""
    stats = engine.speculator.stats if engine.speculator else None
    return (stats.verify_rows, stats.accepted) if stats else (0, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("demo_dir", type=Path)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts (half warm up)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model", type=Path, default=None,
                    help="checkpoint to serve (default DEMO_DIR/base_model; the RL'd demo: "
                         "RUN_DIR/hf of `milepost train recipes/tiny_demo.toml`)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model = a.model or a.demo_dir / "base_model"
    tok = AutoTokenizer.from_pretrained(model)
    lines = (a.demo_dir / "rl_prompts.jsonl").read_text().splitlines()[: a.prompts]
    prompts = [tok.encode(json.loads(x)["prompt"], add_special_tokens=False) for x in lines]
    results = {}
    for scope in (None, "request", "prompt", "engine"):
        results[scope or "plain"] = res = run(model, prompts, a.n, a.temperature, a.rounds,
                                              tok.eos_token_id, scope, a.max_new_tokens, a.device)
        rates = [x["tokens"] / x["seconds"] for x in res["rounds"]]
        base = results["plain"]["rounds"]
        speed = [rt / (b["tokens"] / b["seconds"]) for rt, b in zip(rates, base)]
        print(f"{scope or 'plain':8s} tok/s by round {[round(x) for x in rates]} "
              f"speed-up {[round(x, 2) for x in speed]} tokens {[x['tokens'] for x in res['rounds']]}"
              + (f" acceptance length {res['accept_length']:.2f} (by round "
                 f"{[round(x['accept_length'] or 0, 2) for x in res['rounds']]}) rate "
                 f"{res['accept_rate']:.1%} of {res['proposed']} proposed" if scope else ""),
              flush=True)


if __name__ == "__main__":
    main()
