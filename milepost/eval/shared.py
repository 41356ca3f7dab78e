"""Evaluation on the rollout engines themselves ("shared engines", report table 3).

Under the synchronous loop the engines sit idle while the trainer works, so evaluating on them is
nearly free. The score measures whichever weights the engines hold; `check_versions` proves that
is the version it is recorded against, or the score is rejected (recorded as skipped, with the
reason) — never logged against the wrong step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from milepost.data.source import PromptItem
from milepost.eval.versions import check_versions
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import (
    RolloutError,
    SamplingSettings,
    rollout_groups,
    rollout_metrics,
)
from milepost.rollout.rewards import GroupRewardFn, RewardFn

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """metrics: the `eval/` numbers (without the prefix). skipped_reason: set when the score was
    rejected or the evaluation failed; the metrics then hold only what explains why."""

    metrics: dict[str, float] = field(default_factory=dict)
    skipped_reason: str | None = None


async def evaluate_on_engines(
    clients: Sequence[EngineClient],
    items: Sequence[PromptItem],
    n_samples_per_prompt: int,
    sampling: SamplingSettings,
    reward_fn: RewardFn | None,
    group_reward_fn: GroupRewardFn | None,
    expected_version: str,
    max_concurrency: int = 256,
) -> EvalResult:
    """Every eval prompt once (n samples each); reward mean/std over the scored samples.

    Groups that were aborted or failed are counted, not scored: a score over fewer prompts is
    still a score, and `eval/num_samples` says over how many.
    """
    start = time.perf_counter()
    try:
        result = await rollout_groups(clients, items, n_samples_per_prompt, sampling, reward_fn,
                                      group_reward_fn, max_concurrency)
    except RolloutError as e:
        return EvalResult(skipped_reason=f"every evaluation group failed: {e}")
    samples = [s for g in result.groups for s in g]
    answered = samples + [s for g in (*result.aborted_groups, *result.failed_groups) for s in g]
    versions = check_versions(answered, expected_version)
    metrics = {
        "num_samples": float(len(samples)),
        "failed_groups": float(len(result.failed_groups) + len(result.aborted_groups)),
        "mixed_version_frac": versions.mixed_fraction,
        "time_s": time.perf_counter() - start,
    }
    if versions.mean_version is not None:
        metrics["weight_version"] = versions.mean_version
    reason = versions.reject_reason
    if reason is None and not samples:
        reason = "no evaluation group finished and was scored"
    if reason is not None:
        log.warning("evaluation at weight version %s skipped: %s", expected_version, reason)
        return EvalResult(metrics=metrics, skipped_reason=reason)
    scores = rollout_metrics(result)  # the rollout's own statistics, over the scored samples
    metrics.update({k: scores[k] for k in
                    ("reward_mean", "reward_std", "response_len_mean", "truncated_frac")})
    return EvalResult(metrics=metrics)
