"""Which of the trainer's models have their tensors on the device (report section 3.2).

Between steps every model leaves the device (`offload`, the driver's `--offload-train`) and
comes back (`onload`). With a PPO critic and `--offload-train`, the actor (policy, reference and
the actor's optimizer) and the critic (value model and its optimizer) also take turns *within* a
step: `use("critic")` evicts the actor before the critic's tensors come back, and the other way
round, so a step's peak holds one of them. In that mode `onload` brings nothing back eagerly:
each model returns on its first use, so a step that starts with the critic's values never moves
the actor in only to move it out again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from milepost.train.offload import MoveStats, StateEvictor, trainer_tensors


@dataclass(frozen=True)
class ModelGroup:
    """Models and optimizers that are on the device together (None entries are skipped)."""

    modules: Sequence[nn.Module | None]
    optimizers: Sequence[torch.optim.Optimizer | None]


class Residency:
    """Moves named `ModelGroup`s between the device and the evictor's destination."""

    def __init__(self, groups: dict[str, ModelGroup], evictor: StateEvictor, take_turns: bool) -> None:
        self.groups = groups
        self.evictor = evictor
        self.take_turns = take_turns and len(groups) > 1
        self.offloaded = False
        self._turn_bytes = 0
        self._turn_seconds = 0.0

    def offload(self) -> MoveStats | None:
        """Evict every group still on the device; None when already offloaded."""
        if self.offloaded:
            return None
        moved: list[MoveStats] = []
        done: list[str] = []
        try:
            for name in self.groups:
                if not self.evictor.holds(name):
                    moved.append(self._evict(name))
                    done.append(name)
        except OSError:  # e.g. the disk filled up at the critic: bring the actor back, then raise
            for name in done:
                self.evictor.restore(name)
            raise
        if self.evictor.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks to the colocated engine
        self.offloaded = True
        return MoveStats(sum(m.bytes for m in moved), sum(m.seconds for m in moved))

    def onload(self) -> MoveStats | None:
        """Bring every group back; when groups take turns, none yet (each returns on first use)."""
        if not self.offloaded:
            return None
        self.offloaded = False
        if self.take_turns:
            return MoveStats(0, 0.0)
        moved = [self.evictor.restore(name) for name in self.groups if self.evictor.holds(name)]
        return MoveStats(sum(m.bytes for m in moved), sum(m.seconds for m in moved))

    def use(self, name: str) -> None:
        """Make `name` the group on the device: evict the others first, then restore it."""
        if not self.take_turns or self.offloaded:
            return
        moved: list[MoveStats] = []
        for other in self.groups:
            if other != name and not self.evictor.holds(other):
                moved.append(self._evict(other))
        if self.evictor.holds(name):
            moved.append(self.evictor.restore(name))
        self._turn_bytes += sum(m.bytes for m in moved)
        self._turn_seconds += sum(m.seconds for m in moved)

    def take_turn_stats(self) -> MoveStats | None:
        """Bytes and seconds of the turns taken since the last call; None when groups never take turns."""
        if not self.take_turns:
            return None
        stats = MoveStats(self._turn_bytes, self._turn_seconds)
        self._turn_bytes, self._turn_seconds = 0, 0.0
        return stats

    def resident(self, name: str) -> bool:
        return not self.offloaded and not self.evictor.holds(name)

    def _evict(self, name: str) -> MoveStats:
        group = self.groups[name]
        for module in group.modules:
            for m in module.modules() if module is not None else ():
                if isinstance(m, FSDPModule):
                    m.reshard()  # the unsharded parameters are freed, not moved
        return self.evictor.evict(trainer_tensors(group.modules, group.optimizers), slot=name)
