"""The benchmark's requests: the same token ids and lengths go to milepost and to transformers.

fixed: N prompts of P random tokens, G new tokens each. mixed: prompt and output lengths drawn
uniformly from [min, max] (seeded). prefill: N prompts of L tokens, one new token each.
multiturn: sessions whose turn t+1 prompt is turn t's prompt + its answer + a user message of U
random tokens; the answers exist only once generated, so the engine side builds the prompts as
it goes and records them (`Workload.prompts`) for transformers to replay turn by turn. With
group_size > 1, each group of sessions starts from one shared first prompt (GRPO's samples of
one prompt); their answers and user messages differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FIRST_TOKEN = 10  # random prompt ids start here: clear of the special ids 0-2


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # [requests][tokens]; multiturn: filled in as the turns run
    output_lens: list[int]
    turns: int = 1  # multiturn: requests are session-major: request s*turns + t
    user_msgs: list[list[int]] = field(default_factory=list)  # multiturn: [session*turns + t]

    @property
    def sessions(self) -> int:
        return len(self.output_lens) // self.turns


def _tokens(g: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(FIRST_TOKEN, vocab, (n,), generator=g).tolist()


def fixed(requests: int, prompt_len: int, output_len: int, vocab: int, seed: int,
          n_samples: int = 1) -> Workload:
    """n_samples > 1: each prompt repeated for n consecutive requests (a GRPO group)."""
    g = torch.Generator().manual_seed(seed)
    distinct = [_tokens(g, vocab, prompt_len) for _ in range(requests // n_samples)]
    return Workload("fixed" if n_samples == 1 else f"fixed-n{n_samples}",
                    [list(p) for p in distinct for _ in range(n_samples)], [output_len] * requests)


def mixed(requests: int, lo: int, hi: int, vocab: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed + 1)
    prompt_lens = torch.randint(lo, hi + 1, (requests,), generator=g).tolist()
    output_lens = torch.randint(lo, hi + 1, (requests,), generator=g).tolist()
    return Workload("mixed", [_tokens(g, vocab, n) for n in prompt_lens], output_lens)


def prefill(requests: int, prompt_len: int, vocab: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed + 2)
    return Workload("prefill", [_tokens(g, vocab, prompt_len) for _ in range(requests)],
                    [1] * requests)


def multiturn(sessions: int, turns: int, first_len: int, user_len: int, output_len: int,
              vocab: int, seed: int, group_size: int = 1) -> Workload:
    g = torch.Generator().manual_seed(seed + 3)
    n = sessions * turns
    prompts: list[list[int]] = [[] for _ in range(n)]
    for s in range(sessions):
        fresh = s % group_size == 0
        prompts[s * turns] = _tokens(g, vocab, first_len) if fresh else list(prompts[(s - 1) * turns])
    users = [[] if i % turns == 0 else _tokens(g, vocab, user_len) for i in range(n)]
    name = "multiturn" if group_size == 1 else f"multiturn-g{group_size}"
    return Workload(name, prompts, [output_len] * n, turns=turns, user_msgs=users)


def longest_sequence(w: Workload) -> int:
    """Most tokens (prompt + output) one request of `w` holds."""
    if w.turns == 1:
        return max(len(p) + o for p, o in zip(w.prompts, w.output_lens))
    per_turn = max(len(u) for u in w.user_msgs) + max(w.output_lens)
    return max(len(p) for p in w.prompts) + w.turns * per_turn
