"""FSDP2 training backend: a Hugging Face directory loaded as-is into the native model, sharded.

Every rank of the default process group (gloo on CPU, NCCL on GPU) loads the checkpoint with
`load_model`, then `fully_shard`s each decoder layer and the root (`TokenScorer`, which owns the LM
head so its chunked log-prob pass runs inside the root forward). Pure data parallel: each rank trains
on the samples it is given; gradients are summed across ranks and the loss is pre-divided by the
global loss-token count. Master weights and AdamW state are fp32; `dtype` sets compute, and the
storage of what never trains (a LoRA base, the reference, the teacher).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from milepost.lora.multi_train import AdapterSteps
from milepost.train import checkpoint as ckpt
from milepost.train import micro
from milepost.train.batch import TrainBatch, adapters_of, split_for_rank
from milepost.train.corrections import CorrectionSettings
from milepost.train.critic import Critic
from milepost.train.export import write_hf_directory
from milepost.train.finite import check_after_steps
from milepost.train.fsdp_setup import (
    agreed_steps,
    fsdp_modules,
    seed_everything,
    shard_model,
)
from milepost.train.fsdp_step import (
    behaviour_logprobs,
    clip_gradients,
    correction_weights,
    policy_micro_step,
    step_metrics,
    train_critic,
)
from milepost.train.fsdp_weights import export_adapters, hf_weights
from milepost.train.logprobs import TokenScorer, plan_micro_batches
from milepost.train.losses import METRIC_SUMS, LossSettings, get_loss
from milepost.train.mtp import mtp_params
from milepost.train.offload import MoveStats as OffloadStats
from milepost.train.offload import StateEvictor
from milepost.train.optim import build_optimizer, optimizer_step
from milepost.train.replay import RoutingProbe, is_moe, samples_routing
from milepost.train.residency import ModelGroup, Residency
from milepost.train.settings import TrainerSettings
from milepost.types import Sample

__all__ = ["FSDPBackend", "TrainerSettings", "split_for_rank"]


class FSDPBackend:
    """`TrainBackend` over FSDP2. Build with `FSDPBackend.create(model_path, settings)` on every rank."""

    def __init__(
        self,
        model_path: Path,
        settings: TrainerSettings,
        device: torch.device,
        policy: TokenScorer,
        reference: TokenScorer | None,
        critic: Critic | None = None,
        teacher: TokenScorer | None = None,
    ) -> None:
        self.model_path = model_path
        self.settings = settings
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.policy = policy
        self.reference = reference
        self.teacher = teacher  # on-policy distillation's in-process teacher (scores only)
        stream = (None if settings.optimizer_state_dir is None
                  else Path(settings.optimizer_state_dir) / f"rank_{self.rank}")
        # With LoRA only the adapter trains: the frozen base has no gradients and no Adam state.
        trainable = [p for p in policy.parameters() if p.requires_grad]
        # Multi-LoRA: one AdamW group per adapter (its own lr); only adapters with samples step.
        self.adapter_steps = (AdapterSteps(policy.lm, settings.lora_adapters, settings.lr)
                              if settings.lora_adapters else None)
        groups = self.adapter_steps.param_groups() if self.adapter_steps is not None else trainable
        self.optimizer, self.scheduler = build_optimizer(groups, settings, stream)
        self.critic = critic
        self.loss_fn = get_loss(settings.loss_type, settings.custom_loss_function_path)
        self.loss_settings = LossSettings(
            eps_clip=settings.eps_clip,
            eps_clip_high=settings.clip_high,
            ratio_level=settings.ratio_level,
            aggregation=settings.loss_aggregation,
            kl_loss_coef=settings.kl_loss_coef,
            kl_loss_type=settings.kl_loss_type,
            entropy_coef=settings.entropy_coef,
            value_clip=settings.value_clip,
        )
        self.correction = CorrectionSettings(settings.ratio_correction, settings.tis_clip_low, settings.tis_clip)
        groups = {"actor": ModelGroup([policy, reference, teacher], [self.optimizer])}
        if critic is not None:
            groups["critic"] = ModelGroup([critic.model], [critic.optimizer])
        evictor = StateEvictor(settings.offload_destination, device, directory=settings.offload_dir,
                               staging_bytes=settings.offload_staging_bytes)
        self.residency = Residency(groups, evictor, take_turns=settings.actor_critic_turns)
        self.fp8_scaling = None  # --fp8-scaling delayed: the policy's amax history (lowprec/delayed.py)
        if settings.fp8_scaling == "delayed":
            from milepost.lowprec.train_setup import delayed_scaling_for

            self.fp8_scaling = delayed_scaling_for(settings, policy, [m for m in [reference] if m], device)

    @classmethod
    def create(cls, model_path: str | Path, settings: TrainerSettings) -> FSDPBackend:
        """Collective: call on every rank after `dist.init_process_group` (gloo for cpu, nccl for cuda)."""
        if not dist.is_initialized():
            raise RuntimeError("FSDPBackend.create needs an initialized default process group (dist.init_process_group)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if settings.global_batch_size % world:
            raise ValueError(f"global_batch_size ({settings.global_batch_size}) must be a multiple of the world size ({world})")
        if settings.device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("TrainerSettings.device='cuda' but CUDA is not available; use device='cpu'")
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        seed_everything(settings.seed)
        path = Path(model_path)
        get_loss(settings.loss_type, settings.custom_loss_function_path)  # a bad plug-in fails before loading
        policy = shard_model(path, settings, device, trainable=True)
        if settings.use_rollout_routing_replay and not is_moe(policy):
            raise ValueError(
                f"--use-rollout-routing-replay: {path} is a dense model (no expert routing to replay); "
                "turn it off or train a mixture-of-experts model"
            )
        reference = shard_model(path, settings, device, trainable=False) if settings.needs_reference else None
        critic = Critic(path, settings, device) if settings.critic_lr is not None else None
        teacher = (shard_model(Path(settings.opd_teacher_checkpoint), settings, device, trainable=False)
                   if settings.opd_teacher_checkpoint else None)
        return cls(path, settings, device, policy, reference, critic, teacher)

    # --- collectives helpers -----------------------------------------------------------------------

    def _all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _aligned_plan(self, lengths: list[int]) -> list[list[int]]:
        """Micro-batches of these samples, as many as the busiest rank has (collective)."""
        # --true-on-policy: a budget of 1 token puts every sample alone (batch-invariant forward)
        budget = 1 if self.settings.true_on_policy else self.settings.max_tokens_per_micro_batch
        local = plan_micro_batches(lengths, budget)
        count = int(self._all_reduce([len(local)], dist.ReduceOp.MAX)[0])
        return plan_micro_batches(lengths, budget, count)

    def _require_onloaded(self, what: str, model: str = "actor") -> None:
        if self.residency.offloaded:
            raise RuntimeError(f"FSDPBackend.{what} called while offloaded; call onload() first")
        self.residency.use(model)

    # --- log-probs -------------------------------------------------------------------------------

    @torch.no_grad()
    def _score(self, module: nn.Module, batch: TrainBatch, plan: list[list[int]], values: bool = False) -> list[torch.Tensor]:
        """Per-sample log-probs (TokenScorer) or values (the critic) of `batch`, no grad, on CPU."""
        out: list[torch.Tensor | None] = [None] * len(batch)
        for mb in plan:
            packed = micro.packed(batch, mb, self.device)
            if module is self.policy:
                self._route_adapters(batch, mb, packed)
            forced, _ = self._forced(batch, mb)
            result = module.values(packed, forced) if values else module.score(packed, forced)[0]
            for i, x in zip(mb, result.split([batch.response_lengths[i] for i in mb])):
                out[i] = x.float().cpu()
        for m in fsdp_modules(module):
            m.reshard()  # no-grad forwards leave the root unsharded; keep the registered params sharded
        return out  # type: ignore[return-value]

    def _forced(self, batch: TrainBatch, mb: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        routed = batch.routed_experts if self.settings.use_rollout_routing_replay else None
        lm = self.policy.lm
        return micro.forced_experts(routed, mb, lm.num_layers, lm.moe_top_k, self.device)

    def routed_experts_of(self, samples: Sequence[Sample]) -> list[torch.Tensor] | None:
        """The samples' engine routings decoded for this model (R3), or None when R3 is off."""
        if not self.settings.use_rollout_routing_replay:
            return None
        return samples_routing(samples, self.policy.lm.num_layers, self.policy.lm.moe_top_k)

    def compute_logprobs(self, samples: Sequence[Sample], *, reference: bool = False,
                         teacher: bool = False) -> list[torch.Tensor]:
        self._require_onloaded("compute_logprobs")
        if teacher:
            if self.teacher is None:
                raise ValueError("compute_logprobs(teacher=True) needs an in-process teacher: set opd_teacher_checkpoint")
            module = self.teacher
        else:
            module = self.reference if reference else self.policy
        if module is None:
            raise ValueError("compute_logprobs(reference=True) needs a reference model: set use_kl_loss=True")
        batch = self._scoring_batch(samples)
        return self._score(module, batch, self._aligned_plan([t.numel() for t in batch.tokens]))

    def compute_values(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """The critic's V(s_t) per response token of each sample: [response_length] fp32 on CPU."""
        if self.critic is None:
            raise ValueError("compute_values needs a critic: set critic_lr (--critic-lr)")
        self._require_onloaded("compute_values", "critic")
        batch = self._scoring_batch(samples)
        return self._score(self.critic.model, batch, self._aligned_plan([t.numel() for t in batch.tokens]), values=True)

    def _scoring_batch(self, samples: Sequence[Sample]) -> TrainBatch:
        resp = [s.response_length for s in samples]
        zeros = [torch.zeros(r) for r in resp]
        return TrainBatch([torch.as_tensor(s.tokens, dtype=torch.int64) for s in samples], resp, zeros, zeros,
                          routed_experts=self.routed_experts_of(samples), adapters=adapters_of(samples))

    def _route_adapters(self, batch: TrainBatch, mb: list[int], packed: object) -> None:
        """Multi-LoRA: tell the policy's adapters which tokens of this micro-batch are whose."""
        if self.adapter_steps is not None:
            self.adapter_steps.route(batch.adapters, mb, [batch.tokens[i].numel() for i in mb],
                                     packed.input_ids.numel(), self.device)

    # --- training --------------------------------------------------------------------------------

    def _steps(self, batch: TrainBatch) -> list[list[int]]:
        limit = getattr(self.policy.lm.hf_config, "max_position_embeddings", None)
        return agreed_steps(batch, self.settings, self.world_size, self.device, limit,
                            has_critic=self.critic is not None)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self._require_onloaded("train_step", "critic" if batch.returns is not None else "actor")
        steps = self._steps(batch)
        plans = [self._aligned_plan([batch.tokens[i].numel() for i in step]) for step in steps]
        denoms = [self._all_reduce([float(sum(batch.loss_masks[i].sum() for i in step)),
                                    float(sum(bool((batch.loss_masks[i] > 0).any()) for i in step))])
                  for step in steps]
        # The critic trains first: it is on the device already (it gave the values), so with
        # --offload-actor-for-critic a step moves each model in once. Actor and critic updates are
        # independent, so the order changes no number.
        critic_sums = train_critic(self, batch, steps, plans, denoms) if batch.returns is not None else None
        self.residency.use("actor")
        old, in_forward = behaviour_logprobs(self, batch, steps, plans)
        ref = batch.ref_logprobs
        if ref is None and self.reference is not None:
            ref = self.compute_logprobs_of(batch, self.reference)
        weights, correction_sums, fused_acc = correction_weights(self, batch, old, in_forward)

        # Per-rank sums on the device (one host sync per optimizer step, for the grad norm).
        acc = torch.zeros(len(METRIC_SUMS) + 3, dtype=torch.float64, device=self.device)  # sums, loss, value sums
        loss_tokens, grad_norms, nonfinite = 0.0, [], 0
        lr = self.optimizer.param_groups[0]["lr"]
        probe = RoutingProbe(self.policy) if self.settings.use_rollout_routing_replay else None
        self._mtp_acc = torch.zeros(2, dtype=torch.float64, device=self.device)  # MTP ce sum, rows
        with probe or contextlib.nullcontext():
            for step, plan, denom in zip(steps, plans, denoms):
                loss_tokens += denom[0]
                for local in plan:
                    mb = [step[j] for j in local]
                    acc[:-2] += policy_micro_step(self, batch, mb, old, ref, weights, denom, probe, fused_acc)
                if self.adapter_steps is not None:  # adapters without samples in this step keep still
                    self.adapter_steps.before_step(batch.adapters, step, self._all_reduce)
                # The MTP layer is clipped on its own: the policy's update is the one it gets
                # without --enable-mtp-training (grad_norm reports the policy's).
                grad_norms.append(clip_gradients(mtp_params(self.policy, False), self.settings.clip_grad))
                if self.settings.enable_mtp_training:
                    clip_gradients(mtp_params(self.policy, True), self.settings.clip_grad)
                lr = self.optimizer.param_groups[0]["lr"]
                nonfinite += optimizer_step(self.optimizer, self.scheduler, grad_norms[-1])
                if self.fp8_scaling is not None:  # the step's amaxes, max-reduced over the ranks
                    self.fp8_scaling.step()
        check_after_steps(self.policy.parameters(), nonfinite, lr, self._all_reduce)  # no NaN to engines
        if critic_sums is not None:
            acc[-2:] = critic_sums
        return step_metrics(self, batch, acc=acc, correction_sums=correction_sums, fused_acc=fused_acc,
                            old=old, in_forward=in_forward, probe=probe, loss_tokens=loss_tokens,
                            grad_norms=grad_norms, lr=lr, nonfinite=nonfinite, num_steps=len(steps))

    def compute_logprobs_of(self, batch: TrainBatch, module: TokenScorer) -> list[torch.Tensor]:
        """Log-probs of a TrainBatch's responses under `module` (policy or reference), per sample on CPU."""
        self.residency.use("actor")
        return self._score(module, batch, self._aligned_plan([t.numel() for t in batch.tokens]))

    # --- weights, checkpoints, export ------------------------------------------------------------

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_onloaded("named_hf_weights")
        named = hf_weights(self.policy.lm, self.settings, self.adapter_steps)
        if self.fp8_scaling is None:
            return named
        # --fp8-scaling delayed: the input scales this version's forwards use travel with it (the
        # engines' static activation scales, lowprec/engine_scales.py); after the weights.
        return itertools.chain(named, self.fp8_scaling.input_scales())

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        if self.critic is not None:  # first: a complete actor checkpoint always has its critic
            self._require_onloaded("save_checkpoint", "critic")
            self.critic.save(path)
        self._require_onloaded("save_checkpoint")
        ckpt.save_checkpoint(path, self.policy, self.optimizer, self.scheduler, extra,
                             stateful=self._stateful())

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        self._require_onloaded("load_checkpoint")
        extra = ckpt.load_checkpoint(path, self.policy, self.optimizer, self.scheduler,
                                     stateful=self._stateful())
        if self.critic is not None:
            self._require_onloaded("load_checkpoint", "critic")
            self.critic.load(path)
        return extra

    def _stateful(self) -> dict[str, Any]:
        """Trainer state beyond model and optimizer that a resume must restore exactly."""
        return {"fp8_scaling": self.fp8_scaling} if self.fp8_scaling is not None else {}

    def export_hf(self, path: str | Path) -> None:
        """A Hugging Face directory; with LoRA, a PEFT adapter directory for the base instead."""
        self._require_onloaded("export_hf")
        if self.settings.lora is None:
            write_hf_directory(self.named_hf_weights(), self.model_path, path)
            return
        export_adapters(self.policy.lm, self.settings.lora, self.adapter_steps, self.model_path, path, self.rank)

    # --- offload ---------------------------------------------------------------------------------

    def offload(self) -> OffloadStats | None:
        """Evict weights, gradients and optimizer state (policy, reference, critic); None if already out."""
        return self.residency.offload()

    def onload(self) -> OffloadStats | None:
        """Bring them back (with a critic and --offload-train: each model on its first use)."""
        return self.residency.onload()

    def take_turn_stats(self) -> OffloadStats | None:
        """Moves of the actor / critic turns since the last call (None unless they take turns)."""
        return self.residency.take_turn_stats()
