"""Where every prompt of a fully asynchronous run went: trained, dropped (with the reason), or
still outstanding (generating, or waiting in the buffer).

The ledger owns the data source while a fully-async run is on: the rollout worker draws from it
on its thread and the buffer's drops requeue into it from the trainer's, so every call holds one
lock. Each drawn prompt gets a run-unique group index (GRPO normalizes rewards per group index).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from milepost.data.source import DataSource, PromptItem
from milepost.types import Group


class PromptLedger:
    def __init__(self, data: DataSource, first_group_index: int = 0) -> None:
        self.data = data
        self._lock = threading.Lock()
        self._next_group = first_group_index
        self._outstanding: dict[int, PromptItem] = {}  # group index -> its prompt
        self.drawn = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()  # reason -> groups
        self.retried = 0

    def draw(self) -> tuple[int, PromptItem]:
        """The next prompt and the group index its trajectories carry."""
        with self._lock:
            item = self.data.next_batch(1)[0]
            g = self._next_group
            self._next_group += 1
            self._outstanding[g] = item
            self.drawn += 1
            return g, item

    def trained_groups(self, groups: list[Group]) -> None:
        with self._lock:
            for group in groups:
                self._outstanding.pop(group[0].group_index)
            self.trained += len(groups)

    def drop(self, group: Group, reason: str, retry: bool) -> None:
        """A group not trained on: counted under `reason`; its prompt requeued when `retry`."""
        with self._lock:
            item = self._outstanding.pop(group[0].group_index)
            self.dropped[reason] += 1
            if retry:
                self.data.requeue([item])
                self.retried += 1

    @property
    def num_outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def data_state(self) -> dict[str, Any]:
        """The data source's state with every outstanding prompt first in its retry queue, so a
        resumed run generates again what was generating or waiting when the checkpoint was cut."""
        with self._lock:
            state = dict(self.data.state_dict())
            pending = [it.index for _, it in sorted(self._outstanding.items())]
            state["retry"] = pending + list(state.get("retry", []))
            return state

    def summary(self) -> dict[str, float]:
        """Counts over the whole run (the driver logs them under rollout/fully_async/prompts_*)."""
        with self._lock:
            out = {"prompts_drawn": float(self.drawn), "prompts_trained": float(self.trained),
                   "prompts_retried": float(self.retried),
                   "prompts_outstanding": float(len(self._outstanding))}
            out.update({f"prompts_dropped_{r}": float(n) for r, n in sorted(self.dropped.items())})
            return out
