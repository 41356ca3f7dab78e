"""`LoraSettings`: rank, alpha and target modules of one adapter, validated once for trainer and engine.

Target modules use Hugging Face / PEFT names of the decoder's linear projections. On a
mixture-of-experts layer gate_proj + up_proj and down_proj name the experts' stacked projections
(milepost/lora/experts.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
ALL_LINEAR = "all-linear"  # PEFT's shorthand, accepted for every projection above
POLICY_ADAPTER = "policy"  # the engines' name of the adapter an RL run trains
ADAPTER_SEP = "/"  # "<adapter>/<tensor name>": how weight updates address an adapter's tensors
SAMPLE_ADAPTER_KEY = "lora_adapter"  # multi-LoRA: Sample.metadata key naming the sample's adapter
ADAPTER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")  # a module key and a URL-safe name


def parse_target_modules(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'q_proj,v_proj' or a list -> a validated tuple in canonical order ('all-linear' = all seven)."""
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    if names == [ALL_LINEAR]:
        return TARGET_MODULES
    unknown = [n for n in names if n not in TARGET_MODULES]
    if unknown:
        raise ValueError(
            f"--lora-target-modules: unknown module(s) {unknown}; choose from {list(TARGET_MODULES)} "
            f"(comma-separated) or '{ALL_LINEAR}'"
        )
    if not names:
        raise ValueError(f"--lora-target-modules is empty; name at least one of {list(TARGET_MODULES)}")
    return tuple(n for n in TARGET_MODULES if n in names)


@dataclass(frozen=True)
class LoraSettings:
    """rank: r of A [r, in] and B [out, r]; alpha: the update is B @ A * alpha / r (PEFT's scaling).

    target_modules: projections that get an adapter, in every decoder layer.
    adapters: names of several adapters trained at once (multi-LoRA, same rank and targets);
    empty = one adapter (served as `policy`).
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...] | str = TARGET_MODULES  # a str is split on commas
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"--lora-rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.alpha!r} (PEFT's default is 8; 2 * rank is common)")
        object.__setattr__(self, "target_modules", parse_target_modules(self.target_modules))
        bad = [n for n in self.adapters if not ADAPTER_NAME.match(n)]
        if bad or len(set(self.adapters)) != len(self.adapters):
            raise ValueError(f"[[lora.adapters]] names {list(self.adapters)}: each must be unique and "
                             f"match {ADAPTER_NAME.pattern} (letters, digits, '_', '-')")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
