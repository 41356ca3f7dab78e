"""Rewards for benchmarks and tests on random-weight models, where no real task is solvable.

They are verifiable functions of the generated tokens, so groups get different rewards and the
whole training path (advantages, loss, gradients) does real work.
"""

from __future__ import annotations

from milepost.types import Sample


def token_parity_reward(sample: Sample) -> float:
    """1 when the sum of the response's token ids is even, else 0."""
    return float(sum(sample.response_ids) % 2 == 0)
