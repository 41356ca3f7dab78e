"""NEXTN acceptance length before and after MTP co-training, on a tiny DeepSeek-V3 with one MTP layer.

    python benchmarks/mtp_cotrain.py [--rollouts 128] [--steps 60] [--device cpu|cuda]

Builds the tiny checkpoint (random weights, vocab 64), rolls out greedy continuations of random
prompts with the plain engine, trains the MTP layer on them with the FSDP trainer
(`enable_mtp_training`, zero advantages: the policy does not move), exports, and measures the
NEXTN acceptance length (tokens per verified request-step, k = 3 proposals) on the trained
prompts and on held-out ones, before and after. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.dist import run_ranks
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings

VOCAB = 64


def _progress(msg: str) -> None:
    """Each stage as it ends, on stderr (a run that stops early says how far it got)."""
    print(msg, file=sys.stderr, flush=True)


def generate(path: Path, device: str, n: int, seed: int, spec: bool) -> tuple[list[list[int]], list[int], dict]:
    """Greedy 24-token continuations of n random prompts: (sequences, prompt lengths, stats)."""
    g = torch.Generator().manual_seed(seed)
    flags = {"speculative_algorithm": "NEXTN"} if spec else {}
    engine = build_engine(ServerArgs(model_path=path, device=device, dtype="float32", page_size=4,
                                     max_total_tokens=16384, max_running_requests=64,
                                     **flags).resolved())[0]
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    out: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
                              on_output=lambda o, i=i: out.setdefault(i, []).extend(o.new_token_ids)))
    engine._drain_inbox(block=False)
    t0 = time.perf_counter()
    while engine.scheduler.has_work:
        engine.step()
    seconds = time.perf_counter() - t0
    stats = {"seconds": round(seconds, 3)}
    if spec:
        s = engine.speculator.stats
        stats |= {"accept_length": round(s.accept_length, 3), "accept_rate": round(s.accept_rate, 3)}
    return [p + out[i] for i, p in enumerate(prompts)], [len(p) for p in prompts], stats


def train(rank: int, world: int, ckpt: str, seqs: list, prompt_lens: list, out: str, steps: int,
          device: str) -> list[float]:
    tokens = [torch.tensor(s) for s in seqs]
    resp = [len(s) - p for s, p in zip(seqs, prompt_lens)]
    batch = TrainBatch(tokens, resp, [torch.ones(r) for r in resp], [torch.zeros(r) for r in resp],
                       rollout_logprobs=[torch.zeros(r) for r in resp])
    backend = FSDPBackend.create(ckpt, TrainerSettings(lr=1e-2, global_batch_size=len(seqs), device=device,
                                                       enable_mtp_training=True, mtp_loss_scaling_factor=1.0))
    _progress(f"trainer up on {device} (rank {rank} of {world})")
    losses = []
    for step in range(steps):
        losses.append(backend.train_step(batch)["mtp_loss"])
        if step == 0 or (step + 1) % 10 == 0 or step + 1 == steps:
            _progress(f"train step {step + 1}/{steps}: mtp_loss {losses[-1]:.3f}")
    backend.export_hf(out)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="mtp-cotrain-"))
    ckpt = make_tiny_mtp_checkpoint(root / "before", seed=3, vocab_size=VOCAB)
    seqs, prompt_lens, stats = generate(ckpt, args.device, args.rollouts, 0, spec=False)
    _progress(f"{args.rollouts} greedy rollouts in {stats['seconds']:.1f} s")
    t0 = time.perf_counter()
    (losses,) = run_ranks(train, 1, str(ckpt), seqs, prompt_lens, str(root / "after"), args.steps,
                          args.device, timeout_s=3600, backend="nccl" if args.device == "cuda" else "gloo")
    result = {"rollouts": args.rollouts, "steps": args.steps, "device": args.device,
              "train_seconds": round(time.perf_counter() - t0, 1),
              "mtp_loss_first": round(losses[0], 3), "mtp_loss_last": round(losses[-1], 3)}
    for name in ("before", "after"):
        path = ckpt if name == "before" else root / "after"
        plain_seqs, _, plain = generate(path, args.device, 32, 0, spec=False)
        trained, _, s_trained = generate(path, args.device, 32, 0, spec=True)
        _, _, s_held = generate(path, args.device, 32, 1, spec=True)
        assert trained == plain_seqs == seqs[:32], "speculation changed a greedy output, or the policy moved"
        _progress(f"{name}: acceptance length {s_trained['accept_length']} on trained prompts, "
                  f"{s_held['accept_length']} held out")
        result[name] = {"trained_prompts": s_trained, "held_out_prompts": s_held,
                        "plain_seconds": plain["seconds"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
