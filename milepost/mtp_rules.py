"""Refusals of the multi-token-prediction settings of a training run (config_rules.py calls them).

MTP co-training (`--enable-mtp-training`) needs a checkpoint whose weights hold MTP layers, the
FSDP trainer (where it is implemented) and no LoRA (the adapter would leave the MTP layer
frozen). Engines drafting with NEXTN / EAGLE need the same checkpoint, milepost's engine or
SGLang (both read the flags; external engines are configured where they start). The weight
check pointed at the draft alone needs those layers too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def mtp_refusals(c: TrainConfig) -> list[str]:
    p: list[str] = []
    algo = c.engine_speculative_algorithm
    tuned = [f for f in ("engine_speculative_num_steps", "engine_speculative_eagle_topk",
                         "engine_speculative_num_draft_tokens") if getattr(c, f) is not None]
    if algo is None and tuned:
        p.append(f"--{tuned[0].replace('_', '-')} needs --engine-speculative-algorithm (NGRAM, NEXTN "
                 "or EAGLE); add it or drop the setting")
    if algo is not None and c.engine_backend == "external":
        p.append(f"--engine-speculative-algorithm {algo}: --engine-backend external engines are "
                 "configured where they start; drop it and start them with --speculative-algorithm")
    if c.engine_speculative_ngram_scope is not None and algo != "NGRAM":
        p.append(f"--engine-speculative-ngram-scope is an NGRAM setting; the engines run "
                 f"{algo or 'no speculation'}: add --engine-speculative-algorithm NGRAM or drop it")
    if algo == "NGRAM" and (c.engine_speculative_num_steps or c.engine_speculative_eagle_topk):
        p.append("--engine-speculative-num-steps / --engine-speculative-eagle-topk are NEXTN / EAGLE "
                 "settings; with NGRAM use --engine-speculative-num-draft-tokens")
    if algo in ("NEXTN", "EAGLE") and c.engine_speculative_eagle_topk not in (None, 1):
        p.append(f"--engine-speculative-eagle-topk {c.engine_speculative_eagle_topk}: only 1 (a chain "
                 "of proposals) is implemented; use 1")
    if algo in ("NEXTN", "EAGLE"):
        p += _checkpoint_refusal(c, f"--engine-speculative-algorithm {algo}")
    selector = c.check_weight_update_selector
    if selector != "all" and not c.check_weight_update_equal:
        p.append(f"--check-weight-update-selector {selector} has no effect without "
                 "--check-weight-update-equal; add it or drop the selector")
    elif selector == "draft":
        p += _checkpoint_refusal(c, "--check-weight-update-selector draft")
    if c.enable_mtp_training:
        if c.train_backend != "fsdp":
            p.append(f"--enable-mtp-training is implemented for --train-backend fsdp, not "
                     f"{c.train_backend}; use fsdp or drop it")
        if c.lora_rank:
            p.append("--enable-mtp-training with --lora-rank: the adapter trains the policy, the MTP "
                     "layer would stay frozen; drop one of them")
        if not c.rollout_only:
            p += _checkpoint_refusal(c, "--enable-mtp-training")
    return p


def _checkpoint_refusal(c: TrainConfig, setting: str) -> list[str]:
    from milepost.engine.speculative_setup import mtp_checkpoint_problem

    try:
        problem = mtp_checkpoint_problem(c.hf_checkpoint)
    except (OSError, ValueError) as e:  # the checkpoint's own refusal names it (model_refusals)
        problem = f"{c.hf_checkpoint}/config.json cannot be read ({e})"
    if problem is None:
        return []
    return [f"{setting} needs the checkpoint's multi-token-prediction layers, but {problem}: use "
            f"a checkpoint that ships them, or drop {setting}"]
