"""The multi-LoRA demo's second task (recipes/tiny_demo_multilora.toml): answer with the estimate.

The tiny demo's base model (milepost/demo/) imitated a lazy tutor: for "23+45=" it answers the
exact sum ("68") about a third of the time and otherwise the sum rounded to tens ("~70"). One
adapter learns to compute (`milepost.demo.task:reward`), the other to estimate (this reward);
the two tasks pull the same model in opposite directions, so an adapter that learned the other's
task, or a mix-up of which adapter serves which request, shows in the metrics at once.
"""

from __future__ import annotations

from milepost.demo.task import EOS_TEXT, ESTIMATE_MARK
from milepost.types import Sample


def estimate_reward(sample: Sample) -> float:
    """1 when the response is exactly the tutor's estimate of the labelled sum ("~70"), else 0."""
    if sample.label is None:
        raise ValueError(f"sample {sample.group_index}/{sample.index} has no label (the sum)")
    total = int(sample.label)
    expected = f"{ESTIMATE_MARK}{(total + 5) // 10 * 10}"
    return float(sample.response.removesuffix(EOS_TEXT).strip() == expected)
