"""What `--true-on-policy` costs on CPU: engine and trainer tokens/s with the mode on vs off.

One process, both modes, timed alternately (best of --repeats each, on a busy machine): the
in-process engine serves --requests sampled requests (prompt --prompt-len, --output-len new
tokens, one batch) and the FSDP trainer (one gloo rank) trains on those sequences. Engine tokens/s
counts generated tokens; trainer tokens/s counts every token of the batch. The mode's extra
engine work is one trainer-shaped forward per finished sequence, unfused q/k/v and gate/up
projections; the trainer's is one micro-batch per sample. It also checks the mode's promise on
the batch: the trainer's log-probs equal the engine's (torch.equal) with the mode on.

    python benchmarks/true_on_policy.py --dtype float32 --requests 32
    python benchmarks/true_on_policy.py --device cuda --dtype bfloat16 --shape qwen3-0.6b --requests 64 \
        --prompt-len 128 --output-len 256      # the GPU profile: not run yet (docs/true_on_policy.md)
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

QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096}
SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 32}


def _engine_runner(path: str, device: str, dtype: str, on: bool, prompts: list[list[int]], output_len: int):
    """A function that serves every prompt once (one batch) -> (seconds, [(tokens, logprobs)])."""
    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    args = ServerArgs(model_path=Path(path), device=device, dtype=dtype, max_total_tokens=65536,
                      mem_fraction_static=0.3, true_on_policy=on, disable_radix_cache=True).resolved()
    engine = build_engine(args)[0]

    def run() -> tuple[float, list]:
        outs: dict[int, list] = {}
        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens=output_len, temperature=1.0, sampling_seed=i, ignore_eos=True)
            engine.submit(Request(rid=f"{time.monotonic_ns()}-{i}", prompt_ids=p, params=params,
                                  stop_ids=frozenset(), return_logprob=True,
                                  on_output=lambda o, i=i: outs.setdefault(i, []).append(o)))
        t0 = time.perf_counter()
        engine._drain_inbox(block=False)
        while engine.scheduler.has_work:
            engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return seconds, [(prompts[i] + [t for o in outs[i] for t in o.new_token_ids],
                          [x for o in outs[i] for x in o.new_logprobs]) for i in range(len(prompts))]

    return run


def worker(rank: int, world: int, path: str, device: str, dtype: str, requests: int, prompt_len: int,
           output_len: int, repeats: int) -> dict:
    """Both modes in one process, timed alternately, best of `repeats` each (a busy machine's
    load moves between runs; the best time is the least disturbed one)."""
    from milepost.train.batch import TrainBatch
    from milepost.train.fsdp import FSDPBackend, TrainerSettings

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    engines = {on: _engine_runner(path, device, dtype, on, prompts, output_len) for on in (False, True)}
    best = {("engine", on): float("inf") for on in (False, True)}
    seqs: dict[bool, list] = {}
    for r in range(repeats + 1):  # round 0 warms up
        for on, run in engines.items():
            seconds, seqs[on] = run()
            if r > 0:
                best["engine", on] = min(best["engine", on], seconds)
    rows = {}
    for on in (False, True):
        tokens = [torch.tensor(t) for t, _ in seqs[on]]
        ones = [torch.ones(len(lp)) for _, lp in seqs[on]]
        rollout = [torch.tensor(lp, dtype=torch.float32) for _, lp in seqs[on]]
        batch = TrainBatch(tokens, [len(lp) for _, lp in seqs[on]], ones, ones, rollout_logprobs=rollout)
        backend = FSDPBackend.create(path, TrainerSettings(global_batch_size=requests, dtype=dtype, lr=1e-5, device=device,
                                                           true_on_policy=on, max_tokens_per_micro_batch=16384))
        gap = backend.train_step(batch)["train_rollout_logprob_abs_diff"]  # warm-up; vs the engine's
        rows[on] = (backend, batch, sum(t.numel() for t in tokens), gap)
        best["trainer", on] = float("inf")
    for _ in range(repeats):
        for on, (backend, batch, _, _) in rows.items():
            t0 = time.perf_counter()
            backend.train_step(batch)  # ends with a host sync (metrics), so the time is complete
            best["trainer", on] = min(best["trainer", on], time.perf_counter() - t0)
    return {("off", "on")[on]: {"engine_tok_s": requests * output_len / best["engine", on],
                                "trainer_tok_s": rows[on][2] / best["trainer", on],
                                "abs_diff_step0": rows[on][3]} for on in (False, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="small", choices=["small", "qwen3-0.6b"],
                    help="random weights: the small CPU shape or the Qwen3-0.6B shape (GPU)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per mode (best is kept)")
    ns = ap.parse_args()
    from milepost.testing.checkpoints import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        shape = SHAPE if ns.shape == "small" else QWEN3_06B
        vocab = 2048 if ns.shape == "small" else 151936
        path = str(make_tiny_checkpoint(Path(tmp) / "m", ns.arch, vocab_size=vocab, with_tokenizer=False, **shape))
        [res] = run_ranks(worker, 1, path, ns.device, ns.dtype, ns.requests, ns.prompt_len, ns.output_len, ns.repeats,
                          timeout_s=1800, backend="nccl" if ns.device == "cuda" else "gloo")
        rows = {False: res["off"], True: res["on"]}
    print(json.dumps({"machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
                      "torch": torch.__version__, "args": vars(ns), "shape": shape,
                      "off": rows[False], "on": rows[True]}, indent=1))
    for key in ("engine_tok_s", "trainer_tok_s"):
        print(f"{key}: off {rows[False][key]:.0f}  on {rows[True][key]:.0f}  "
              f"on/off {rows[True][key] / rows[False][key]:.2f}")
    print(f"train_rollout_logprob_abs_diff at step 0: off {rows[False]['abs_diff_step0']:.3g}  "
          f"on {rows[True]['abs_diff_step0']:.3g}")


if __name__ == "__main__":
    main()
