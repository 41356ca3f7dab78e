"""What `--true-on-policy` costs on CPU: engine and trainer tokens/s with the mode on vs off.

One process per side and mode, all in one run (same machine, same load): the in-process engine
serves --requests sampled requests (prompt --prompt-len, --output-len new tokens, one batch) and
the FSDP trainer (one gloo rank) takes --train-steps steps on those sequences. Engine tokens/s
counts generated tokens; trainer tokens/s counts every token of the batch. The mode's extra
engine work is one trainer-shaped forward per finished sequence, unfused q/k/v and gate/up
projections; the trainer's is one micro-batch per sample. It also checks the mode's promise on
the batch: the trainer's log-probs equal the engine's (torch.equal) with the mode on.

    python benchmarks/true_on_policy.py --dtype float32 --requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from milepost.testing.dist import run_ranks

SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 32}


def _engine_side(path: str, dtype: str, on: bool, requests: int, prompt_len: int, output_len: int):
    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    args = ServerArgs(model_path=Path(path), device="cpu", dtype=dtype, max_total_tokens=65536,
                      true_on_policy=on, disable_radix_cache=True).resolved()
    engine = build_engine(args)[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    outs: dict[int, list] = {}

    def run() -> float:
        outs.clear()
        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens=output_len, temperature=1.0, sampling_seed=i, ignore_eos=True)
            engine.submit(Request(rid=f"{time.monotonic_ns()}-{i}", prompt_ids=p, params=params,
                                  stop_ids=frozenset(), return_logprob=True,
                                  on_output=lambda o, i=i: outs.setdefault(i, []).append(o)))
        t0 = time.perf_counter()
        engine._drain_inbox(block=False)
        while engine.scheduler.has_work:
            engine.step()
        return time.perf_counter() - t0

    run()  # warm-up
    seconds = run()
    seqs = [(prompts[i] + [t for o in outs[i] for t in o.new_token_ids],
             [x for o in outs[i] for x in o.new_logprobs]) for i in range(requests)]
    return requests * output_len / seconds, seqs


def worker(rank: int, world: int, path: str, dtype: str, on: bool, requests: int, prompt_len: int,
           output_len: int, train_steps: int) -> dict:
    from milepost.train.batch import TrainBatch
    from milepost.train.fsdp import FSDPBackend, TrainerSettings

    torch.set_num_threads(1)
    engine_tps, seqs = _engine_side(path, dtype, on, requests, prompt_len, output_len)
    backend = FSDPBackend.create(path, TrainerSettings(global_batch_size=requests, dtype=dtype, lr=1e-5,
                                                       true_on_policy=on, max_tokens_per_micro_batch=16384))
    tokens = [torch.tensor(t) for t, _ in seqs]
    ones = [torch.ones(len(lp)) for _, lp in seqs]
    rollout = [torch.tensor(lp, dtype=torch.float32) for _, lp in seqs]
    batch = TrainBatch(tokens, [len(lp) for _, lp in seqs], ones, ones, rollout_logprobs=rollout)
    first = backend.train_step(batch)  # also the warm-up; its gap is against the engine's log-probs
    t0 = time.perf_counter()
    for _ in range(train_steps):
        backend.train_step(batch)
    seconds = time.perf_counter() - t0
    n_tokens = sum(t.numel() for t in tokens)
    return {"engine_tok_s": engine_tps, "trainer_tok_s": n_tokens * train_steps / seconds,
            "abs_diff_step0": first["train_rollout_logprob_abs_diff"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=2)
    ns = ap.parse_args()
    from milepost.testing.checkpoints import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_checkpoint(Path(tmp) / "m", ns.arch, vocab_size=2048, with_tokenizer=False, **SHAPE))
        rows = {}
        for on in (False, True):
            [rows[on]] = run_ranks(worker, 1, path, ns.dtype, on, ns.requests, ns.prompt_len, ns.output_len,
                                   ns.train_steps, timeout_s=1200)
    print(json.dumps({"machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
                      "torch": torch.__version__, "args": vars(ns), "shape": SHAPE,
                      "off": rows[False], "on": rows[True]}, indent=1))
    for key in ("engine_tok_s", "trainer_tok_s"):
        print(f"{key}: off {rows[False][key]:.0f}  on {rows[True][key]:.0f}  "
              f"on/off {rows[True][key] / rows[False][key]:.2f}")
    print(f"train_rollout_logprob_abs_diff at step 0: off {rows[False]['abs_diff_step0']:.3g}  "
          f"on {rows[True]['abs_diff_step0']:.3g}")


if __name__ == "__main__":
    main()
