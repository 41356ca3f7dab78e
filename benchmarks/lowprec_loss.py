"""Loss curves of supervised training under each trainer format, fixed synthetic task.

A small Qwen3 (transformers' model, random init, seed fixed) learns next-token prediction on
sequences from a fixed random successor table; the same data and seed for every format. Prints
the mean loss of the last 10 of `--steps` Adam steps and its gap to the unquantized run.

    python benchmarks/lowprec_loss.py --steps 200
    python benchmarks/lowprec_loss.py --steps 200 --device cuda   # bf16 model, Hopper FP8 GEMMs
    python benchmarks/lowprec_loss.py --formats none,fp8_block,fp8_block+delayed,fp8_block+delayed-recent

`fp8_block+delayed` is `--fp8-scaling delayed` with Transformer Engine's defaults (amax history
1024 steps, max, margin 0); `+delayed-recent` uses the last step's amax (most_recent);
`nvfp4+sr` is `--nvfp4-stochastic-rounding` (the gradients rounded stochastically).

On CUDA the model is bf16 (the "none" row is then plain bf16, the baseline the issue names); the
data is drawn on the host from the same generator, so every format and device sees the same batches.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from milepost.lowprec.contract import Contract
from milepost.lowprec.delayed import DelayedSettings, attach_delayed
from milepost.lowprec.linear import apply_train_precision


def run(fmt: str, steps: int, seed: int, device: str = "cpu") -> list[float]:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   vocab_size=64, max_position_embeddings=64)
    model = transformers.Qwen3ForCausalLM(cfg)
    if device == "cuda":
        model = model.to(device, torch.bfloat16)
    fmt, _, option = fmt.partition("+")
    if fmt != "none":
        apply_train_precision(model, Contract(fmt, fmt), stochastic_rounding=option == "sr")
    delayed = None
    if option.startswith("delayed"):  # delayed | delayed-recent: --fp8-scaling delayed
        algo = "most_recent" if option == "delayed-recent" else "max"
        delayed = attach_delayed(model, DelayedSettings(algo=algo), torch.device(device))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    succ = torch.randperm(64, generator=gen)  # the task: token t+1 = succ[token t], with noise
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 64, (16, 1), generator=gen)
        seq = [start]
        for _ in range(31):
            nxt = succ[seq[-1]]
            noise = torch.rand(nxt.shape, generator=gen) < 0.1
            seq.append(torch.where(noise, torch.randint(0, 64, nxt.shape, generator=gen), nxt))
        ids = torch.cat(seq, 1).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if delayed is not None:
            delayed.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.add_argument("--formats", default="none,fp8_block,mxfp8,nvfp4,int4")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = {}
    for fmt in a.formats.split(","):
        t0 = time.monotonic()
        losses = run(fmt, a.steps, a.seed, a.device)
        end = sum(losses[-10:]) / 10
        out[fmt] = {"first": losses[0], "end": end, "seconds": round(time.monotonic() - t0, 1)}
        base = out.get("none", out[fmt])["end"]
        print(f"{fmt:10} loss {losses[0]:.3f} -> {end:.4f} (last 10 mean), vs unquantized "
              f"{(end - base) / base:+.2%}, {out[fmt]['seconds']} s", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
