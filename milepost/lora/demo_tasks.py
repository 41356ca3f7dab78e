"""The multi-LoRA demo's second task (recipes/tiny_demo_multilora.toml): answer with an estimate.

The tiny demo's base model (milepost/demo/) imitated a lazy tutor: for "23+45=" it answers the
exact sum ("68") about a third of the time and otherwise an estimate, the sum rounded to tens
("~70"). One adapter learns to compute (`milepost.demo.task:reward`), the other to estimate (this
reward); the two tasks pull the same model in opposite directions, so an adapter that learned the
other's task, or a mix-up of which adapter serves which request, shows in the metrics at once.
"""

from __future__ import annotations

import re

from milepost.demo.task import EOS_TEXT, ESTIMATE_MARK
from milepost.types import Sample

_ESTIMATE = re.compile(re.escape(ESTIMATE_MARK) + r"(0|[1-9]\d{0,11})", re.ASCII)


def estimate_reward(sample: Sample) -> float:
    """1 for an estimate of the labelled sum: "~" and a multiple of ten at most 10 from it, else 0.

    The tutor rounds half up ("~70" for 68); the base model's own estimates of 300 sums were that
    rounding 182 times and ten off 23 times (2026-12-03), so ten off also counts: the task is to
    answer by estimate, not the rounding arithmetic. An exact answer ("68") scores 0."""
    if sample.label is None:
        raise ValueError(f"sample {sample.group_index}/{sample.index} has no label (the sum)")
    m = _ESTIMATE.fullmatch(sample.response.removesuffix(EOS_TEXT).strip())
    if m is None:
        return 0.0
    value = int(m.group(1))
    return float(value % 10 == 0 and abs(value - int(sample.label)) <= 10)
