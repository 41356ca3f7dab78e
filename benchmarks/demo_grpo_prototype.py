"""Standalone GRPO on the demo task (plain PyTorch + transformers), to prove RL raises the reward.

No milepost engine or trainer: transformers' `generate` samples, the same model scores, and a
PPO-clip loss over group-normalized advantages updates it with AdamW. It prints the mean reward
of every rollout and the wall time, so the recipe's hyperparameters have a measured curve.

    python benchmarks/demo_grpo_prototype.py   # builds runs/tiny-demo (data + base model) first
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from milepost.demo.task import read_jsonl, reward
from milepost.types import Sample

PAD_ID, EOS_ID = 0, 2


def encode_prompts(tok, records: list[dict]) -> list[list[int]]:
    """Token ids of each record's prompt: text as is, chat messages through the chat template."""
    out = []
    for r in records:
        if isinstance(r["prompt"], str):
            out.append(tok.encode(r["prompt"], add_special_tokens=False))
        else:
            out.append(
                tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
    return out


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new: int, temperature: float) -> list[list[int]]:
    """Sample one response per prompt (left-padded batch); each response ends at EOS or max_new."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )[:, width:]
    responses = []
    for row in out.tolist():
        resp = []
        for t in row:
            resp.append(t)
            if t == EOS_ID:
                break
        responses.append(resp)
    return responses


def response_logprobs(
    model, prompts: list[list[int]], responses: list[list[int]], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp: [B, R] of each response token (right-padded), mask: [B, R] 1 on real response tokens."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    r_width = max(map(len, responses))
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature  # [B, T, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    # Gather the log-prob of response token j (position len(p)+j) from position len(p)+j-1.
    pos = torch.zeros(len(seqs), r_width, dtype=torch.long)
    tgt = torch.zeros(len(seqs), r_width, dtype=torch.long)
    mask = torch.zeros(len(seqs), r_width)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pos[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        tgt[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    rows = torch.arange(len(seqs))[:, None]
    logp = logp_all[rows, pos].gather(-1, tgt[..., None])[..., 0]
    return logp * mask, mask


def grpo_advantages(rewards: torch.Tensor, n: int, normalize_std: bool) -> torch.Tensor:
    """rewards: [G*n] grouped contiguously -> advantages [G*n] (reward minus group mean, / std)."""
    r = rewards.view(-1, n)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-6)
    return adv.view(-1)


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps: float, eps_high: float
) -> tuple[torch.Tensor, float]:
    """PPO-clip loss as the token mean over the batch (as milepost's trainer aggregates it);
    returns (loss, fraction of tokens where the clipped term was taken)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - eps, 1 + eps_high)
    loss_tok = torch.maximum(unclipped, clipped)
    denom = mask.sum().clamp(min=1)
    return (loss_tok * mask).sum() / denom, (((clipped > unclipped).float() * mask).sum() / denom).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, default=Path("runs/tiny-demo"))
    ap.add_argument("--model", type=Path, default=None, help="base model dir (default: build one in work-dir)")
    ap.add_argument("--prompts", type=Path, default=None, help="RL prompt JSONL (default: work-dir's)")
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--rollout-batch-size", type=int, default=32, help="prompts per rollout")
    ap.add_argument("--n-samples", type=int, default=8, help="samples per prompt (group size)")
    ap.add_argument("--global-batch-size", type=int, default=256, help="samples per optimizer step")
    ap.add_argument("--max-response-len", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=5, help="optimizer steps of linear lr warmup")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--eps-clip", type=float, default=0.2)
    ap.add_argument("--eps-clip-high", type=float, default=0.28)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--no-std-norm", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.8, help="report when the 5-rollout mean reward reaches this")
    ap.add_argument("--log", type=Path, default=None, help="write per-rollout metrics as JSONL here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()
    if args.model is None or args.prompts is None:
        from milepost.demo.prepare import prepare

        model_dir, prompts_path = prepare(args.work_dir)
        args.model = args.model or model_dir
        args.prompts = args.prompts or prompts_path
    t_prep = time.time() - t_start

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    records = read_jsonl(args.prompts)
    encoded = encode_prompts(tok, records)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay
    )
    n, B = args.n_samples, args.rollout_batch_size
    total = B * n
    if total % args.global_batch_size:
        raise ValueError("rollout_batch_size * n_samples must be a multiple of global_batch_size")
    log_f = args.log.open("w") if args.log else None
    order = list(range(len(records)))
    rng.shuffle(order)
    cursor = 0
    t0, cpu0 = time.time(), time.process_time()
    reached = None
    updates = 0
    history: list[float] = []
    print(f"prepare {t_prep:.1f}s; model {args.model}; {len(records)} prompts; {vars(args)}", flush=True)
    for step in range(1, args.rollouts + 1):
        t_step = time.time()
        if cursor + B > len(order):
            rng.shuffle(order)
            cursor = 0
        idx = order[cursor : cursor + B]
        cursor += B
        prompts = [encoded[i] for i in idx for _ in range(n)]
        model.eval()
        responses = sample(model, prompts, args.max_response_len, args.temperature)
        t_gen = time.time() - t_step
        rewards = []
        for j, (p, r) in enumerate(zip(prompts, responses)):
            rec = records[idx[j // n]]
            s = Sample(
                group_index=j // n,
                index=j % n,
                tokens=p + r,
                response_length=len(r),
                prompt=rec["prompt"],
                response=tok.decode(r, skip_special_tokens=True),
                label=rec["label"],
            )
            rewards.append(reward(s))
        rewards_t = torch.tensor(rewards)
        adv = grpo_advantages(rewards_t, n, not args.no_std_norm)
        with torch.no_grad():
            old_logp, _ = response_logprobs(model, prompts, responses, args.temperature)
        model.train()
        perm = torch.randperm(total)
        clipfracs, gnorms = [], []
        for k in range(0, total, args.global_batch_size):
            mb = perm[k : k + args.global_batch_size].tolist()
            logp, mask = response_logprobs(
                model, [prompts[i] for i in mb], [responses[i] for i in mb], args.temperature
            )
            old = old_logp[mb][:, : logp.shape[1]]
            loss, cf = policy_loss(logp, old, adv[mb], mask, args.eps_clip, args.eps_clip_high)
            updates += 1
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, updates / args.warmup) if args.warmup else args.lr
            opt.zero_grad()
            loss.backward()
            gnorms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad).item())
            opt.step()
            clipfracs.append(cf)
        elapsed = time.time() - t0
        mean_r = rewards_t.mean().item()
        resp_len = sum(map(len, responses)) / len(responses)
        history.append(mean_r)
        avg5 = sum(history[-5:]) / len(history[-5:])
        row = {
            "step": step, "reward": round(mean_r, 4), "reward_avg5": round(avg5, 4),
            "time_s": round(elapsed, 2), "cpu_s": round(time.process_time() - cpu0, 1),
            "gen_s": round(t_gen, 2), "step_s": round(time.time() - t_step, 2),
            "resp_len": round(resp_len, 2), "clipfrac": round(sum(clipfracs) / len(clipfracs), 4),
            "grad_norm": round(max(gnorms), 3),
        }
        print(json.dumps(row), flush=True)
        if log_f:
            log_f.write(json.dumps(row) + "\n")
        if reached is None and step >= 5 and avg5 >= args.target:
            reached = (step, elapsed)
    if reached:
        print(
            f"mean reward of 5 consecutive rollouts first >= {args.target} at rollout {reached[0]} "
            f"after {reached[1]:.1f}s of RL"
        )
    else:
        print(f"the 5-rollout mean reward never reached {args.target}")
    print(
        f"RL time {time.time() - t0:.1f}s wall, {time.process_time() - cpu0:.1f}s CPU "
        f"(+ prepare {t_prep:.1f}s)"
    )


if __name__ == "__main__":
    main()
