"""Run-config refusals and derived defaults of the precision contract (`--precision` and its
side settings): the report's pairing rules, and what a quantized run cannot combine with yet."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from milepost.lowprec.contract import (
    BF16,
    EXPERTS_SERVED,
    Contract,
    contract_refusals,
    layer_overrides,
    parse_overrides,
    sides,
)
from milepost.lowprec.fp8_checkpoint import unquantized_weights
from milepost.lowprec.formats import block_shape
from milepost.lowprec.quant_checkpoint import checkpoint_quant

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def run_contract(c: TrainConfig) -> Contract:
    train, rollout = sides(c.precision, c.train_precision, c.rollout_precision)
    return Contract(train, rollout, _overrides(c), c.nvfp4_four_over_six)


def _num_layers(c: TrainConfig) -> int | None:
    try:
        return int(json.loads((c.hf_checkpoint / "config.json").read_text())["num_hidden_layers"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _overrides(c: TrainConfig) -> tuple[tuple[str, str], ...]:
    """--precision-override, after the first / last layers the recipe keeps in bf16 (resolved
    against the checkpoint's layer count; unreadable = refused by precision_refusals)."""
    by_layer: tuple[tuple[str, str], ...] = ()
    first, last = c.precision_bf16_first_layers, c.precision_bf16_last_layers
    if first or last:
        n = _num_layers(c)
        by_layer = layer_overrides(first, last, n) if n else ()
    return by_layer + parse_overrides(c.precision_override or [])


def precision_refusals(c: TrainConfig) -> list[str]:
    train, rollout = sides(c.precision, c.train_precision, c.rollout_precision)
    try:
        overrides = _overrides(c)
    except ValueError as e:
        return [str(e)]
    p = contract_refusals(train, rollout, overrides, four_over_six=c.nvfp4_four_over_six,
                          dequantized_backward=c.nvfp4_dequantized_backward)
    p += layer_refusals(c, train, rollout) + fp8_scaling_refusals(c, train)
    if c.fp8_w8a8_experts and rollout != "fp8_block":
        p.append("--fp8-w8a8-experts quantizes the fp8_block engines' MoE expert inputs; the "
                 f"engines serve {rollout} (--precision {c.precision}): drop it or use --precision "
                 "bf16-train-fp8-serve or fp8")
    if c.nvfp4_stochastic_rounding and train != "nvfp4":
        p.append("--nvfp4-stochastic-rounding rounds the NVFP4 trainer's gradients; the trainer "
                 f"runs {train} (--precision {c.precision}): drop it or use --precision nvfp4")
    p += checkpoint_refusals(c, Contract(train, rollout, overrides, c.nvfp4_four_over_six))
    if train == BF16 and rollout == BF16:
        return p
    what = f"--precision {c.precision} (trainer {train}, engines {rollout})"
    if train != BF16 and c.train_backend != "fsdp":  # Megatron's linears are its own, not ours
        p.append(f"{what} with --train-backend {c.train_backend}: the quantized trainer is the "
                 "FSDP backend's (its linears are swapped for milepost's quantized ones); use "
                 "--train-backend fsdp, or keep the trainer bf16 (--precision bf16-train-fp8-serve)")
    if c.engine_quantization is not None:
        p.append(f"{what} with --engine-quantization {c.engine_quantization}: one weight format "
                 "for the engines; drop --engine-quantization")
    if rollout != BF16 and c.engine_backend != "embedded":
        p.append(f"{what}: the engines' quantized storage is milepost's engine; use "
                 "--engine-backend embedded")
    if c.lora_rank:
        p.append(f"{what} with --lora-rank: LoRA does not stack on these quantized linears yet; "
                 "for an fp8 base on the engines use --engine-quantization fp8 (docs/lora.md)")
    if c.true_on_policy:
        p.append(f"{what} with --true-on-policy: quantized weights cannot give bitwise-equal "
                 "log-probs; use --precision bf16")
    p += shape_refusals(c, Contract(train, rollout, overrides, c.nvfp4_four_over_six))
    if c.nvfp4_dequantized_backward and train != "nvfp4":
        p.append("--nvfp4-dequantized-backward changes the NVFP4 trainer's backward; the "
                 f"trainer runs {train}: drop it")
    if c.nvfp4_stochastic_rounding and c.nvfp4_dequantized_backward:
        p.append("--nvfp4-stochastic-rounding with --nvfp4-dequantized-backward: the dequantized "
                 "backward quantizes no gradient to round; choose one")
    return p


def checkpoint_refusals(c: TrainConfig, contract: Contract) -> list[str]:
    """A quantized checkpoint (FP8 or INT4, lowprec/quant_checkpoint.py): the trainer
    dequantizes it at load; the engines serve it as the contract says (from its own values
    where the rollout format is its store, else dequantized), which only milepost's engine
    does. A covered tensor the checkpoint kept unquantized stays so on the engines: a quantized
    trainer must keep it too."""
    try:
        ckpt = checkpoint_quant(c.hf_checkpoint)
    except ValueError as e:  # a layout the engines cannot hold: refused now, not in a worker
        return [str(e)]
    if ckpt is None:
        return []
    p = []
    if c.engine_backend != "embedded":
        p.append(f"{c.hf_checkpoint} is a quantized checkpoint ({ckpt.layout}): the engines serve "
                 "it by the precision contract (from its values, or dequantized), which "
                 f"milepost's engine does; use --engine-backend embedded, not {c.engine_backend}")
    if contract.train != BF16:
        kept = [n for n in unquantized_weights(c.hf_checkpoint)
                if contract.tensor_format(n, "train") != BF16]
        if kept:
            shown = ", ".join(kept[:3]) + (f", ... ({len(kept) - 3} more)" if len(kept) > 3 else "")
            p.append(f"{c.hf_checkpoint} keeps {shown} unquantized (modules_to_not_convert) and "
                     "the engines serve them so, but the trainer would quantize them "
                     f"({contract.train}): add --precision-override NAME=bf16 for each (or a "
                     "glob / layers.A-B covering them)")
    return p


def layer_refusals(c: TrainConfig, train: str, rollout: str) -> list[str]:
    """--precision-bf16-first-layers / --precision-bf16-last-layers: a quantized run, and a
    checkpoint whose layer count is known and large enough."""
    asked = [(f"--precision-bf16-{side}-layers {k}", k) for side, k in
             (("first", c.precision_bf16_first_layers), ("last", c.precision_bf16_last_layers)) if k]
    if not asked:
        return []
    what = " / ".join(f for f, _ in asked)
    if train == BF16 and rollout == BF16:
        return [f"{what} keeps layers unquantized; this run quantizes nothing "
                f"(--precision {c.precision}): drop it or set a quantized --precision"]
    n = _num_layers(c)
    if n is None:
        return [f"{what}: {c.hf_checkpoint}/config.json gives no num_hidden_layers to count the "
                "layers from; use --precision-override layers.A-B=bf16 instead"]
    return [f"{f}: the model has {n} decoder layers ({c.hf_checkpoint}); use at most {n}"
            for f, k in asked if k > n]


def fp8_scaling_refusals(c: TrainConfig, train: str) -> list[str]:
    """--fp8-scaling delayed needs the FP8 blockwise trainer (MX and NVFP4 block scales are the
    formats' own; int4 quantizes no activations) on the FSDP backend; its knobs need it."""
    p: list[str] = []
    # Changed from their defaults (the trainer re-reads a dumped config: every field is "set").
    knobs = [f"--{k.replace('_', '-')}" for k in ("fp8_amax_history_len", "fp8_amax_compute_algo",
                                                    "fp8_margin")
             if getattr(c, k) != type(c).model_fields[k].default]
    if c.fp8_scaling == "current":
        if knobs:
            p.append(f"{', '.join(knobs)} set the delayed-scaling recipe; this run has "
                     "--fp8-scaling current: add --fp8-scaling delayed or drop them")
        return p
    if train != "fp8_block":
        p.append(f"--fp8-scaling delayed needs an FP8 trainer (--precision fp8); the trainer runs "
                 f"{train} (--precision {c.precision}): drop --fp8-scaling or use --precision fp8")
    if c.train_backend != "fsdp":
        p.append(f"--fp8-scaling delayed with --train-backend {c.train_backend}: the delayed "
                 "recipe is the FSDP trainer's; use --train-backend fsdp")
    return p


def ratio_correction_default(c: TrainConfig) -> str | None:
    """TIS by default when the engines serve a quantized copy of a bf16 trainer's weights (the
    gap the report corrects), MoE experts under `--precision fp8` included (the trainer keeps
    them bf16: for experts that arrangement is bf16-train-fp8-serve); None = keep the configured
    value. `--fp8-scaling delayed` is one format on both sides again: the engines take the
    trainer's input scales with every update (`--fp8-activation-scheme static`, every transport),
    so no TIS for it."""
    if "ratio_correction" in c.model_fields_set:
        return None
    train, rollout = sides(c.precision, c.train_precision, c.rollout_precision)
    if train == BF16 and rollout != BF16:
        return "tis"
    if rollout in EXPERTS_SERVED and _experts_served_quantized(c, run_contract(c)):
        return "tis"
    return None


def _experts_served_quantized(c: TrainConfig, contract: Contract) -> bool:
    """Whether the checkpoint (its config.json) has MoE experts the engines quantize and the
    trainer does not."""
    try:
        cfg = json.loads((c.hf_checkpoint / "config.json").read_text())
        experts, layers = int(cfg.get("num_experts") or 0), int(cfg["num_hidden_layers"])
    except (OSError, KeyError, TypeError, ValueError):
        return False
    return experts > 0 and any(
        contract.tensor_format(f"model.layers.{i}.mlp.experts.0.{p}_proj.weight", "rollout")
        != contract.tensor_format(f"model.layers.{i}.mlp.experts.0.{p}_proj.weight", "train")
        for i in range(layers) for p in ("gate", "up", "down"))


def shape_refusals(c: TrainConfig, contract: Contract) -> list[str]:
    """Covered tensors whose contraction dim the format's block does not divide, read from the
    checkpoint's config.json before anything starts (each stage refuses them again, by name)."""
    try:
        cfg = json.loads((c.hf_checkpoint / "config.json").read_text())
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"]) * int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return []  # not a config we can read here: the stages check the real shapes
    k_of = {"self_attn.q_proj": hidden, "self_attn.k_proj": hidden, "self_attn.v_proj": hidden,
            "self_attn.o_proj": heads, "mlp.gate_proj": hidden, "mlp.up_proj": hidden,
            "mlp.down_proj": inter}
    bad: dict[str, tuple[str, int, int]] = {}
    for i in range(layers):
        for part, k in k_of.items():
            name = f"model.layers.{i}.{part}.weight"
            for side in ("train", "rollout"):
                fmt = contract.tensor_format(name, side)
                block = block_shape(fmt, "activation")[1] if fmt != BF16 else 1
                if fmt in ("mxfp8", "nvfp4") and k % block:
                    bad.setdefault(part, (fmt, k, block))
    return [f"{c.hf_checkpoint}: model.layers.N.{part}.weight has {k} input features, not a "
            f"multiple of {fmt}'s block of {block}; keep it in bf16 (--precision-override "
            f"'*.{part.split('.')[-1]}.weight=bf16') or use --precision fp8"
            for part, (fmt, k, block) in bad.items()]


def engine_precision_flags(cfg: TrainConfig) -> list[str]:
    """`milepost serve` flags for the engines' side of `cfg`'s contract."""
    contract = run_contract(cfg)
    if contract.rollout == BF16:
        # A quantized checkpoint would otherwise be served by its store (engine/server_args_precision.py).
        quantized = cfg.engine_quantization is None and checkpoint_quant(cfg.hf_checkpoint) is not None
        return ["--dequantize-checkpoint"] if quantized else []
    flags = ["--quantization", contract.rollout]
    if contract.overrides:
        flags += ["--precision-override", ",".join(f"{p}={f}" for p, f in contract.overrides)]
    if contract.four_over_six:
        flags += ["--nvfp4-four-over-six"]
    if cfg.fp8_w8a8_experts:  # refused at start unless the engines serve fp8_block
        flags += ["--fp8-w8a8-experts"]
    if contract.rollout == "fp8_block" and cfg.fp8_scaling == "delayed":
        flags += ["--fp8-activation-scheme", "static"]  # the trainer sends its input scales
    elif contract.rollout == "fp8_block" and checkpoint_quant(cfg.hf_checkpoint) is not None:
        # The trainer quantizes inputs per 1 x 128 block: a checkpoint's static input scales
        # (activation_scheme static) would give the engines another forward.
        flags += ["--fp8-activation-scheme", "dynamic"]
    return flags
