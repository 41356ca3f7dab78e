"""Building the FSDP2 backend's models and checking a batch before a step: the parts of
`FSDPBackend` that need no backend state (fsdp.py and fsdp_step.py keep the step itself)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_layer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from milepost.lora.adapters import attach_lora, freeze_base, store_frozen_in
from milepost.models.layers import set_fused_training
from milepost.models.registry import load_model
from milepost.onpolicy.contract import LOGPROB_CHUNK
from milepost.train.batch import TrainBatch
from milepost.train.compile import compile_decoder_layers
from milepost.train.logprobs import TokenScorer
from milepost.train.settings import TrainerSettings


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def shard_model(model_path: Path, s: TrainerSettings, device: torch.device, trainable: bool) -> TokenScorer:
    """Load `model_path` as fp32 masters, wrap it for scoring, and `fully_shard` each layer and the root.

    What never trains (a LoRA run's frozen base, the reference, the teacher) is stored in the
    compute dtype: a bf16 run keeps 2 bytes per frozen parameter, not 4, with the same results."""
    lm = load_model(model_path, torch.float32, "cpu")  # fp32 master weights; fully_shard moves each shard
    if trainable and s.lora is not None:
        attach_lora(lm, s.lora)  # the reference / teacher stay the plain base
    if (not trainable or s.lora is not None) and s.precision == "bf16":  # quantized trainers quantize fp32
        store_frozen_in(lm, s.torch_dtype)
    if s.precision != "bf16":  # quantized linears, the engines' quantizer (milepost/lowprec/)
        from milepost.lowprec.train_setup import quantize_trainer

        quantize_trainer(lm, s, device)
    fused = s.fused_kernels and device.type == "cuda" and not s.true_on_policy
    chunk = LOGPROB_CHUNK if s.true_on_policy else s.logprob_chunk_size  # the engine re-scores with it
    scorer = TokenScorer(lm, s.temperature, chunk, fused=fused)
    if trainable and s.enable_mtp_training:
        if not getattr(lm, "num_mtp_layers", 0):
            raise ValueError(f"enable_mtp_training: {model_path} has no multi-token-prediction layers "
                             "(num_nextn_predict_layers and their model.layers.N.* weights); turn it off")
        scorer.mtp_training = True
    mp = MixedPrecisionPolicy(param_dtype=s.torch_dtype, reduce_dtype=torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if s.compile_layers and trainable:
        if lm.moe_top_k:
            raise ValueError(f"compile_layers: {model_path} is a mixture-of-experts model; "
                             "compiled layers are for dense models so far (turn compile_layers off)")
        set_fused_training(lm, False)  # compiled layers fuse their elementwise ops themselves
        compile_decoder_layers(lm.model.layers)
    for layer in lm.model.layers:
        if s.activation_checkpointing == "layer" and trainable:
            # composable checkpoint keeps parameter names (HF names) unlike a wrapper module
            checkpoint_layer(layer)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(scorer, mesh=mesh, mp_policy=mp)
    for m in fsdp_modules(scorer):
        # Sum, not average, across ranks: each rank's loss is already divided by the global token count.
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    scorer.requires_grad_(trainable)
    if trainable and s.lora is not None:
        freeze_base(scorer)
    return scorer


def agreed_steps(batch: TrainBatch, settings: TrainerSettings, world_size: int, device: torch.device,
                 max_positions: int | None, *, has_critic: bool) -> list[list[int]]:
    """Optimizer steps as local index lists, after checking that all ranks agree on the batch shape
    (collective).

    The optional fields decide which collectives run (old/ref log-prob passes, the critic), so a
    rank that has them while a peer has not would hang both: refuse it instead, naming the field.
    """
    per_rank = settings.global_batch_size // world_size
    optional = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "returns", "routed_experts")
    mine = [len(batch)] + [getattr(batch, f) is not None for f in optional]
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    rows = [g.tolist() for g in gathered]
    sizes = [r[0] for r in rows]
    if len(set(sizes)) > 1 or sizes[0] == 0 or sizes[0] % per_rank:
        raise ValueError(
            f"train_step needs the same non-zero multiple of global_batch_size / world_size = {per_rank} "
            f"samples on every rank, got {sizes} per rank; split the rollout with split_for_rank"
        )
    longest = max(t.numel() for t in batch.tokens)
    if max_positions and longest > max_positions:
        raise ValueError(
            f"a sample has {longest} tokens, more than the model's max_position_embeddings ({max_positions}); "
            "shorten the prompts or lower rollout_max_response_len so prompt + response fit"
        )
    for j, field in enumerate(optional, start=1):
        if len({r[j] for r in rows}) > 1:
            raise ValueError(
                f"TrainBatch.{field} is set on ranks {[i for i, r in enumerate(rows) if r[j]]} only; "
                "every rank must give it or none (e.g. rollout log-probs missing from some samples)"
            )
    if settings.use_rollout_routing_replay and batch.routed_experts is None:
        raise ValueError("--use-rollout-routing-replay: TrainBatch.routed_experts is missing")
    if batch.returns is not None and (not has_critic or batch.values is None):
        raise ValueError("TrainBatch.returns trains the critic: it needs critic_lr and TrainBatch.values")
    return [list(range(i, i + per_rank)) for i in range(0, len(batch), per_rank)]
