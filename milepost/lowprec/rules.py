"""Run-config refusals and derived defaults of the precision contract (`--precision` and its
side settings): the report's pairing rules, and what a quantized run cannot combine with yet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from milepost.lowprec.contract import (
    BF16,
    Contract,
    contract_refusals,
    parse_overrides,
    sides,
)

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def run_contract(c: TrainConfig) -> Contract:
    train, rollout = sides(c.precision, c.train_precision, c.rollout_precision)
    return Contract(train, rollout, parse_overrides(c.precision_override or []),
                    c.nvfp4_four_over_six)


def precision_refusals(c: TrainConfig) -> list[str]:
    train, rollout = sides(c.precision, c.train_precision, c.rollout_precision)
    try:
        overrides = parse_overrides(c.precision_override or [])
    except ValueError as e:
        return [str(e)]
    p = contract_refusals(train, rollout, overrides, four_over_six=c.nvfp4_four_over_six,
                          dequantized_backward=c.nvfp4_dequantized_backward)
    if train == BF16 and rollout == BF16:
        return p
    what = f"--precision {c.precision} (trainer {train}, engines {rollout})"
    if c.engine_quantization is not None:
        p.append(f"{what} with --engine-quantization {c.engine_quantization}: one weight format "
                 "for the engines; drop --engine-quantization")
    if rollout != BF16 and c.engine_backend != "embedded":
        p.append(f"{what}: the engines' quantized storage is milepost's engine; use "
                 "--engine-backend embedded")
    if c.lora_rank:
        p.append(f"{what} with --lora-rank: adapters on a quantized base are not served yet")
    if c.true_on_policy:
        p.append(f"{what} with --true-on-policy: quantized weights cannot give bitwise-equal "
                 "log-probs; use --precision bf16")
    if c.nvfp4_dequantized_backward and train != "nvfp4":
        p.append("--nvfp4-dequantized-backward changes the NVFP4 trainer's backward; the "
                 f"trainer runs {train}: drop it")
    return p


def ratio_correction_default(c: TrainConfig) -> str | None:
    """TIS by default when the engines serve a quantized copy of a bf16 trainer's weights (the
    gap the report corrects); None = keep the configured value."""
    train, rollout = sides(c.precision, c.train_precision, c.rollout_precision)
    if train == BF16 and rollout != BF16 and "ratio_correction" not in c.model_fields_set:
        return "tis"
    return None
