"""Accuracy of a checkpoint on a prompt file, through a real `milepost serve` (CPU or CUDA).

Measures a model before training (or any HF directory after) the way a run's evaluation does:
chat-templated prompts, the run's reward fn on each response, mean reward per temperature. Used
for the SmolLM2 reasoning-gym recipe's base accuracy (docs/environments.md).

    python benchmarks/prompt_accuracy.py MODEL_DIR PROMPTS.jsonl \\
        --reward-fn milepost.connectors.reasoning_gym:reward --temperatures 0 1 --max-new 32
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import httpx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("prompts", type=Path, help="JSONL rows with `prompt` (chat messages) and `metadata`")
    p.add_argument("--reward-fn", required=True, help="module.sub:fn(sample) -> float")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--n-samples", type=int, default=1, help="samples per prompt at temperature > 0")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0 = all)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args()

    from transformers import AutoTokenizer

    from milepost.plugins import load_callable
    from milepost.testing.server_process import ServerProcess
    from milepost.types import Sample

    reward = load_callable(a.reward_fn, "--reward-fn")
    rows = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    rows = rows[: a.limit] if a.limit else rows
    tok = AutoTokenizer.from_pretrained(a.model)
    ids = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for r in rows]
    results: dict[str, float] = {}
    # A fixed KV pool (--max-total-tokens wins over the memory fraction): the server takes the
    # same memory beside other processes on the GPU, whatever they hold.
    with ServerProcess(a.model, "--device", a.device, "--max-total-tokens", "65536",
                       timeout_s=600) as srv:
        for temp in a.temperatures:
            n = 1 if temp == 0 else a.n_samples
            t0 = time.perf_counter()
            out = httpx.post(f"{srv.url}/generate", timeout=3600, json={
                "input_ids": [x for x in ids for _ in range(n)],
                "sampling_params": {"temperature": temp, "max_new_tokens": a.max_new}}).json()
            if not isinstance(out, list):
                raise SystemExit(f"/generate answered {str(out)[:500]}")
            scores = [reward(Sample(group_index=i // n, index=i, tokens=[], response_length=0,
                                    prompt=rows[i // n]["prompt"], response=o["text"],
                                    label=rows[i // n].get("label"),
                                    metadata=rows[i // n].get("metadata", {})))
                      for i, o in enumerate(out)]
            # accuracy: share of full scores; mean_reward also counts partial credit (reasoning-gym
            # gives some tasks' near misses a fraction), which is what a run's reward_mean shows.
            acc = sum(s >= 1.0 for s in scores) / len(scores)
            mean = sum(scores) / len(scores)
            results[f"T{temp:g}"] = acc
            results[f"T{temp:g}_mean_reward"] = mean
            print(f"{a.model.name} {a.prompts.name} T={temp:g} samples={len(scores)} "
                  f"accuracy={acc:.3f} mean_reward={mean:.3f} ({time.perf_counter() - t0:.0f} s) "
                  f"e.g. {out[0]['text'][:80]!r} label {rows[0].get('label')!r}", flush=True)
            # What the model answers most: shows a policy that learned one frequent answer.
            common = Counter(o["text"].strip() for o in out).most_common(5)
            print("  most common replies:", ", ".join(f"{t[:40]!r} x{c}" for t, c in common))
    if a.json_out:
        a.json_out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
