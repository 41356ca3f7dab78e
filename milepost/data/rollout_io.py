"""Saving and loading a step's rollout groups (`--save-rollouts DIR` / `--load-rollouts DIR`).

One JSONL file per step, `rollout_{step:06d}.jsonl`, one group a line (a JSON list of samples as
`Sample.to_dict`). Files are written to a temporary name and renamed, so a reader never sees a
half-written step, even if the writer dies mid-way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from milepost.types import Group, Sample


def rollout_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"rollout_{step:06d}.jsonl"


def save_rollout(directory: str | Path, step: int, groups: list[Group]) -> Path:
    """Write `groups` of training step `step` under `directory` (created if missing)."""
    path = rollout_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for g, group in enumerate(groups):
                try:
                    line = json.dumps([s.to_dict() for s in group])
                except TypeError as e:  # e.g. a reward function put an object in metadata
                    raise TypeError(f"save_rollout: group {g} of step {step} is not JSON "
                                    f"serializable ({e}); keep sample metadata to JSON values"
                                    ) from e
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_rollout(directory: str | Path, step: int) -> list[Group]:
    """The groups `save_rollout` wrote for `step`."""
    path = rollout_path(directory, step)
    if not path.is_file():
        raise FileNotFoundError(f"load_rollout: no saved rollout for step {step} ({path}); "
                                "--load-rollouts needs a directory written by --save-rollouts "
                                "covering every step the run trains")
    groups: list[Group] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            try:
                groups.append([Sample.from_dict(d) for d in json.loads(line)])
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:line {n}: not a saved group ({e})") from e
    return groups
