"""A session path becomes one contiguous training sequence (report 2.4, figure 3).

tokens: every id the engine saw or produced, in order. The first turn's prompt is the sample's
prompt; everything after it is the response, with loss mask 1 exactly on the ids the model sampled
(tool results, user turns and template glue are 0). Rollout log-probs and weight versions are the
engine's for sampled ids (0.0 / the turn's weight version elsewhere). Routed experts are stitched
so each row comes from the call that first processed that token.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from milepost.session.divergence import counts as divergence_counts
from milepost.session.store import Session, Turn
from milepost.types import Sample, Status

_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def stitch_routed_experts(path: list[Turn]) -> str | None:
    """Rows [0, len(ids) - 1) of the leaf's sequence. Turn k's call processed the tokens from the
    previous turn's last output id (never fed back before) up to its own last-but-one id, so its
    rows [len(prev ids) - 1, len(ids) - 1) are the ones that sampled this turn's tokens."""
    if not path or any(t.routed_experts is None for t in path):
        return None
    parts, start = [], 0
    row = None
    for turn in path:
        flat = np.frombuffer(base64.b64decode(turn.routed_experts), dtype=np.int32)
        rows_here = len(turn.ids) - 1
        if rows_here <= 0 or flat.size % rows_here:
            raise ValueError(f"turn {turn.id}: routed experts hold {flat.size} ints, not a whole "
                             f"number of rows for {rows_here} tokens")
        row = flat.size // rows_here
        parts.append(flat.reshape(rows_here, row)[start:rows_here])
        start = rows_here
    return base64.b64encode(np.concatenate(parts).astype(np.int32).tobytes()).decode()


def build_sample(session: Session, leaf: Turn, *, group_index: int = 0, index: int = 0,
                 label: Any = None) -> Sample:
    path = leaf.path()
    first = path[0]
    prompt_len = len(first.prompt_ids)
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[str] = []
    for k, turn in enumerate(path):
        n_prompt = 0 if k == 0 else len(turn.prompt_ids)
        mask += [0] * n_prompt + [1] * len(turn.output_ids)
        logprobs += [0.0] * n_prompt + list(turn.logprobs)
        versions += [turn.weight_version] * n_prompt + list(turn.weight_versions)
    tokens = leaf.ids
    sample = Sample(
        group_index=group_index, index=index, tokens=list(tokens),
        response_length=len(tokens) - prompt_len, prompt=first.messages[:-1], label=label,
        loss_mask=mask, rollout_logprobs=logprobs, weight_versions=versions,
        routed_experts=stitch_routed_experts(path),
        status=_STATUS.get(str(leaf.finish_reason.get("type")), Status.ABORTED),
        metadata={"session_id": session.id, "leaf_turn": leaf.id, "turns": len(path),
                  "messages": leaf.messages,
                  "cached_tokens": sum(t.cached_tokens for t in path),
                  "prompt_tokens": sum(len(t.ids) - len(t.output_ids) for t in path),
                  "session_unparsed_tool_calls": sum(t.unparsed_tool_calls for t in path),
                  # session-wide (the same on every leaf; rollout metrics count each session once)
                  **divergence_counts(session.divergences)},
    )
    return sample


def build_samples(session: Session, leaves: list[Turn] | None = None) -> list[Sample]:
    chosen = session.leaves() if leaves is None else leaves
    return [build_sample(session, leaf, index=i) for i, leaf in enumerate(chosen)]
