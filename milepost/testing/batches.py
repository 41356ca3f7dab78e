"""Random `TrainBatch`es for trainer tests: varied lengths, partly masked responses, rollout log-probs."""

from __future__ import annotations

import torch

from milepost.train.batch import TrainBatch


def random_train_batch(n: int, seed: int, vocab: int = 512, min_len: int = 6, max_len: int = 24) -> TrainBatch:
    """n samples of min_len..max_len tokens (ids >= 3, past the special tokens), each with a random
    response length, ~20% of response tokens masked out, N(0, 1) advantages and rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    tokens, resp, masks, adv, rollout = [], [], [], [], []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        r = int(torch.randint(1, length - 1, (1,), generator=g))
        tokens.append(torch.randint(3, vocab, (length,), generator=g))
        resp.append(r)
        masks.append((torch.rand(r, generator=g) > 0.2).float())
        adv.append(torch.randn(r, generator=g))
        rollout.append(-torch.rand(r, generator=g) * 5)
    return TrainBatch(tokens, resp, masks, adv, rollout_logprobs=rollout)
