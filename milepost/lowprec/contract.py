"""The precision contract (report 3.1): which format each side runs, per tensor, and the refusals.

`--precision` names an arrangement (trainer format, rollout format); `--train-precision` /
`--rollout-precision` set one side explicitly. Allowed: the same format on both sides, or a bf16
trainer with quantized rollout, except NVFP4, which every stage touching the weights must use.
Overrides (`PATTERN=bf16`, PATTERN a tensor-name glob or `layers.A-B`) keep tensors in bf16; one
function (`tensor_format`) answers for all four stages (checkpoint conversion, trainer forward,
engine, live export), so an override cannot apply at one stage and not another.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from milepost.lowprec.formats import FORMATS

BF16 = "bf16"
# --precision arrangement -> (trainer format, rollout format); bf16 = not quantized.
ARRANGEMENTS: dict[str, tuple[str, str]] = {
    "bf16": (BF16, BF16),
    "bf16-train-fp8-serve": (BF16, "fp8_block"),
    "fp8": ("fp8_block", "fp8_block"),
    "mxfp8": ("mxfp8", "mxfp8"),
    "nvfp4": ("nvfp4", "nvfp4"),
    "int4": ("int4", "int4"),  # quantization-aware training: fake-quant trainer, INT4 engines
}
SIDE_FORMATS = (BF16, *FORMATS)
_ARRANGEMENT_OF = {t: name for name, (t, r) in ARRANGEMENTS.items() if t == r and t != BF16}
# The linears a quantized recipe covers (module names' last part); embeddings, norms, the LM
# head and routers stay in bf16. MoE experts (`...mlp.experts.N.gate|up|down_proj.weight`):
# under fp8_block the engines serve them in FP8 (128 x 128 weight tiles, activations in the model
# dtype) while the trainer keeps them in bf16, in both fp8_block arrangements: for experts the
# contract is bf16-train-fp8-serve. Under int4 they are INT4 on both sides (the trainer's
# fake-quant experts, lowprec/experts_int4.py; engines hold them packed). Under mxfp8 / nvfp4
# experts stay bf16 on both sides.
COVERED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERTS_SERVED = ("fp8_block", "int4")  # rollout formats that quantize MoE experts
EXPERTS_TRAINED = ("int4",)  # trainer formats that quantize them too (QAT: fake-quant forward)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_RANGE = re.compile(r"^layers\.(\d+)-(\d+)$")


@dataclass(frozen=True)
class Contract:
    """What the trainer and the engines quantize, tensor by tensor."""

    train: str
    rollout: str
    overrides: tuple[tuple[str, str], ...] = ()
    four_over_six: bool = False

    def tensor_format(self, hf_name: str, side: str) -> str:
        """The format of weight `hf_name` ('...q_proj.weight') on `side` ('train' | 'rollout')."""
        base = self.train if side == "train" else self.rollout
        module = hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
        if base == BF16 or not hf_name.endswith(".weight") or module not in COVERED:
            return BF16
        quantized_experts = EXPERTS_SERVED if side == "rollout" else EXPERTS_TRAINED
        if ".experts." in hf_name and base not in quantized_experts:
            return BF16
        for pattern, fmt in self.overrides:
            if _matches(pattern, hf_name):
                return fmt
        return base


def _matches(pattern: str, hf_name: str) -> bool:
    r = _RANGE.match(pattern)
    if r:
        m = _LAYER.search(hf_name)
        return m is not None and int(r.group(1)) <= int(m.group(1)) <= int(r.group(2))
    return fnmatch.fnmatchcase(hf_name, pattern)


def parse_overrides(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`PATTERN=FORMAT` strings -> pairs; raises ValueError naming the bad item."""
    out = []
    for item in items:
        pattern, sep, fmt = item.partition("=")
        if not sep or not pattern or fmt not in SIDE_FORMATS:
            raise ValueError(f"--precision-override {item!r}: write PATTERN=FORMAT, PATTERN a "
                             f"tensor-name glob or layers.A-B, FORMAT one of {', '.join(SIDE_FORMATS)}")
        r = _RANGE.match(pattern)
        if r and int(r.group(1)) > int(r.group(2)):
            raise ValueError(f"--precision-override {item!r}: the layer range is empty")
        out.append((pattern, fmt))
    return tuple(out)


def layer_overrides(first: int, last: int, num_layers: int) -> tuple[tuple[str, str], ...]:
    """`--precision-bf16-first-layers N` / `--precision-bf16-last-layers M` as the `layers.A-B=bf16`
    overrides they mean for a model of `num_layers` decoder layers (resolved once, at start, so
    every stage receives plain ranges)."""
    out = []
    if first > 0:
        out.append((f"layers.0-{min(first, num_layers) - 1}", BF16))
    if last > 0:
        out.append((f"layers.{max(num_layers - last, 0)}-{num_layers - 1}", BF16))
    return tuple(out)


def sides(precision: str, train: str | None, rollout: str | None) -> tuple[str, str]:
    t, r = ARRANGEMENTS[precision]
    return train or t, rollout or r


def contract_refusals(train: str, rollout: str, overrides: tuple[tuple[str, str], ...],
                      *, four_over_six: bool = False, dequantized_backward: bool = False) -> list[str]:
    """The report's rules for a (trainer, rollout) pair; each message names the settings and fix."""
    p: list[str] = []
    if train == BF16 and rollout == "nvfp4":
        p.append("--rollout-precision nvfp4 with a bf16 trainer: NVFP4 needs every stage that "
                 "touches the weights to quantize them (report 3.1); use --precision nvfp4")
    elif train != BF16 and train != rollout:
        p.append(f"--train-precision {train} with --rollout-precision {rollout}: the two sides "
                 "run the same format, or the trainer stays bf16: set --precision "
                 f"{_ARRANGEMENT_OF.get(train, train)} alone")
    for pattern, fmt in overrides:
        if fmt not in (BF16, train, rollout) or (fmt != BF16 and train != rollout):
            p.append(f"--precision-override {pattern}={fmt}: an override keeps tensors in bf16 or "
                     f"in the run's one format ({rollout}), applied at all four stages")
    if (four_over_six or dequantized_backward) and "nvfp4" not in (train, rollout):
        flag = "--nvfp4-four-over-six" if four_over_six else "--nvfp4-dequantized-backward"
        p.append(f"{flag} refines the NVFP4 recipe; this run's formats are {train} (trainer) and "
                 f"{rollout} (rollout): drop it or use --precision nvfp4")
    return p


def native_support(fmt: str, capability: tuple[int, int] | None) -> bool:
    """Whether a device (CUDA compute capability; None = CPU) has `fmt`'s GEMMs: FP8 on
    Hopper (9.0) and Blackwell, MXFP8 / NVFP4 on Blackwell (10.0+)."""
    if fmt == BF16:
        return True
    if capability is None or fmt == "int4":  # no INT4 kernel here: emulated everywhere
        return False
    return capability >= ((9, 0) if fmt == "fp8_block" else (10, 0))
