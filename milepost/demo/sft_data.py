"""Chat data for the demo's SFT recipe: `python -m milepost.demo.sft_data OUT_DIR [--n N]`.

Writes OUT_DIR/sft_chat.jsonl: conversations of one or two exact additions (user "23+45=",
assistant "68"), drawn from their own seed so they do not repeat the RL prompts' order. The demo
base model has only seen plain "23+45=68"; SFT teaches it the chat format and exact answers.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from milepost.demo.task import problems, write_jsonl

SFT_SEED = 20261202


def chat_records(n: int, seed: int = SFT_SEED) -> list[dict]:
    """`n` rows {"messages": [...]}; about a third hold two question/answer turns."""
    rng, stream = random.Random(seed), problems(seed)
    rows = []
    for _ in range(n):
        messages = []
        for _ in range(2 if rng.random() < 1 / 3 else 1):
            p = next(stream)
            messages += [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.answer}]
        rows.append({"messages": messages})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m milepost.demo.sft_data", description=__doc__)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--n", type=int, default=4096)
    args = ap.parse_args(argv)
    path = write_jsonl(args.out_dir / "sft_chat.jsonl", chat_records(args.n))
    print(f"wrote {args.n} conversations to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
