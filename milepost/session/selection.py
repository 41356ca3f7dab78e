"""Which leaves of a session become training sequences (report 2.4.1: "each leaf selected by the
server yields one training sequence"), `--session-leaf-selection`:

- `latest`: the leaf of the most recent turn (one sequence per session, like a linear session);
- `all`: every leaf, oldest first (a branching session that forked yields several sequences);
- `module.sub:fn`: a selector `(samples: list[Sample]) -> list[Sample]` that receives one sample
  per leaf (oldest first; `metadata` holds `leaf_turn`, `turns`, `messages`) and returns the
  ones to train on, a non-empty subset.
"""

from __future__ import annotations

from collections.abc import Callable

from milepost.plugins import load_callable
from milepost.types import Sample

LeafSelector = Callable[[list[Sample]], list[Sample]]


class LeafSelectionError(ValueError):
    """The run's selector broke its contract (the server answers 500 with this message)."""


def _latest(samples: list[Sample]) -> list[Sample]:
    return [max(samples, key=lambda s: s.metadata["leaf_turn"])] if samples else []


def _all(samples: list[Sample]) -> list[Sample]:
    return list(samples)


BUILTIN_SELECTIONS: dict[str, LeafSelector] = {"latest": _latest, "all": _all}


def load_leaf_selector(spec: str) -> LeafSelector:
    if spec in BUILTIN_SELECTIONS:
        return BUILTIN_SELECTIONS[spec]
    return load_callable(spec, "--session-leaf-selection")


def select_leaves(selector: LeafSelector, samples: list[Sample]) -> list[Sample]:
    """The selector's choice, checked: a non-empty subset of `samples` (when there are any)."""
    if not samples:
        return []
    chosen = selector(list(samples))
    ids = {id(s) for s in samples}
    if not isinstance(chosen, list) or not all(id(s) in ids for s in chosen):
        raise LeafSelectionError("--session-leaf-selection: the selector must return a list made "
                                 "of the samples it was given (one per leaf)")
    if not chosen:
        raise LeafSelectionError("--session-leaf-selection: the selector chose no leaf; a "
                                 "session that called the model must yield a sequence")
    return chosen
