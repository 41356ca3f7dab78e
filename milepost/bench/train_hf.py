"""The baseline of `milepost bench train`: a plain Hugging Face training loop.

transformers' model with sdpa attention and gradient checkpointing, fp32 master weights under
bf16 autocast on CUDA (the precision milepost's trainer uses: bf16 compute, fp32 weights and
AdamW state), torch AdamW (fused on CUDA, as milepost's), and a policy-gradient loss from
log_softmax of the response positions' logits (`logits_to_keep` skips the prompt rows' LM head).
"""

from __future__ import annotations

import contextlib
import time

import torch


def hf_train_steps(
    path: str, tokens: torch.Tensor, advantages: torch.Tensor, response: int, micro_batch: int,
    steps: int, device: torch.device,
) -> dict[str, float]:
    """tokens: [samples, seq] int64, advantages: [samples, response]; one warm-up, then `steps`
    timed optimizer steps. Returns the step times and the peak device memory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), fused=device.type == "cuda")
    total = float(tokens.shape[0] * response)

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step() -> float:
        loss_sum = 0.0
        for s in range(0, tokens.shape[0], micro_batch):
            ids = tokens[s : s + micro_batch].to(device, non_blocking=True)
            adv = advantages[s : s + micro_batch].to(device, non_blocking=True)
            with autocast():
                logits = model(input_ids=ids, logits_to_keep=response + 1).logits[:, :-1]  # [b, R, V]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, -response:, None])[..., 0]
            loss = -(logp * adv).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum

    times = []
    for i in range(steps + 1):
        _sync(device)
        if i == 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        step()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"step_times": times, "peak_gib": peak}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
