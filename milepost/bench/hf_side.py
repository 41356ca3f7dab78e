"""Runs a workload through transformers `generate` in static batches: the baseline.

Each batch is left-padded to its longest prompt and generates its longest output for every row
(that is what a static batch costs); only the tokens each request asked for are counted.
Multiturn replays, turn by turn, the prompts milepost's sessions produced (same token ids), with
no cache across turns (generate has none).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from milepost.bench.workloads import Workload

PAD_ID = 0


@dataclass
class HFResult:
    seconds: float
    prompt_tokens: int
    output_tokens: int


def run_hf(model: torch.nn.Module, w: Workload, batch_size: int | None, temperature: float,
           device: torch.device) -> HFResult:
    # generate fills unset settings from the model's own config: clear its EOS, or rows stop early
    model.generation_config.eos_token_id = None
    order = [i for t in range(w.turns) for i in range(t, len(w.output_lens), w.turns)]  # turn-major
    size = batch_size or (len(order) // w.turns)
    batches = []
    for t in range(w.turns):
        turn = order[t * w.sessions:(t + 1) * w.sessions] if w.turns > 1 else order
        batches += [turn[s:s + size] for s in range(0, len(turn), size)]
    _sync(device)
    t0 = time.perf_counter()
    for rows in batches:
        _generate(model, [w.prompts[i] for i in rows], max(w.output_lens[i] for i in rows),
                  temperature, device)
    _sync(device)
    return HFResult(time.perf_counter() - t0, sum(len(p) for p in w.prompts), sum(w.output_lens))


def _generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
              temperature: float, device: torch.device) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    config = GenerationConfig(  # no EOS: every row generates exactly new_tokens (ignore_eos)
        max_new_tokens=new_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
        eos_token_id=None, pad_token_id=PAD_ID)
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {new_tokens}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
