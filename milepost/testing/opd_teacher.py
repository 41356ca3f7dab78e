"""A distillation teacher for the tiny demo: its base model trained further on exact drills.

The demo's base model can add but imitates a lazy tutor (exact about a third of the time); a
few more supervised steps on exact answers (the demo's drill stream) make it compute again. Used
by the on-policy distillation recipe and tests as a fast stand-in for an RL-trained teacher.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from milepost.demo.base_model import batches, evaluate
from milepost.demo.recipe import DemoModelRecipe
from milepost.demo.task import dataset_seeds, problems

IGNORE = -100


def make_drill_teacher(base_model: str | Path, out_dir: str | Path, *, target: float = 0.9,
                       lr: float = 1e-3, max_steps: int = 400, check_every: int = 10,
                       seed: int = 0) -> dict[str, float]:
    """Train `base_model` on exact drills until its greedy held-out accuracy reaches `target`;
    save it (HF directory with the tokenizer) to `out_dir`. Returns the last held-out check.
    Raises RuntimeError naming the numbers when `max_steps` do not reach `target`."""
    torch.manual_seed(seed)
    base_model, out_dir = Path(base_model), Path(out_dir)
    tok = AutoTokenizer.from_pretrained(base_model)
    model = Qwen3ForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    held_out = [p for p, _ in zip(problems(dataset_seeds(seed)["held_out"] + 1), range(256))]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    data = batches(DemoModelRecipe(seed=seed), "drills")
    m = {}
    for step in range(1, max_steps + 1):
        ids, mask, labels = _batch(tok, next(data))
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % check_every == 0:
            model.eval()
            with torch.no_grad():
                m = {**evaluate(model, tok, held_out), "steps": float(step)}
            if m["greedy_accuracy"] >= target:
                break
    else:
        raise RuntimeError(f"the drill teacher reached greedy accuracy {m.get('greedy_accuracy')} "
                           f"< {target} in {max_steps} steps; raise max_steps or lr")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base_model / name).exists():
            shutil.copy(base_model / name, out_dir / name)
    (out_dir / "teacher.json").write_text(json.dumps(m, indent=1) + "\n")
    return m


def _batch(tok, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] ids, attention mask and labels (the answer + EOS only)."""
    pairs = [(tok.encode(r["prompt"], add_special_tokens=False),
              tok.encode(r["response"], add_special_tokens=False) + [tok.eos_token_id]) for r in records]
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, IGNORE)
    for i, (p, a) in enumerate(pairs):
        n = len(p) + len(a)
        ids[i, :n], mask[i, :n] = torch.tensor(p + a), 1
        labels[i, len(p):n] = torch.tensor(a)
    return ids, mask, labels


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m milepost.testing.opd_teacher",
                                     description="Write the demo's drill-trained distillation teacher.")
    parser.add_argument("base_model", help="the demo's base model (python -m milepost.demo.prepare)")
    parser.add_argument("out_dir")
    parser.add_argument("--target", type=float, default=0.9, help="greedy held-out accuracy to reach")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    m = make_drill_teacher(args.base_model, args.out_dir, target=args.target)
    print(f"teacher written to {args.out_dir}: greedy accuracy {m['greedy_accuracy']:.3f} "
          f"after {int(m['steps'])} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
