"""Built-in group filters for `--group-filter` (fully async: a rejected group is discarded on arrival)."""

from __future__ import annotations

from milepost.types import Group


def rewards_differ(group: Group) -> bool:
    """Keep a group only if its rewards are not all equal: equal rewards give every sample a
    zero group-relative advantage, so the group carries no gradient signal (report table 1)."""
    rewards = [s.reward for s in group]
    return len(set(rewards)) > 1
