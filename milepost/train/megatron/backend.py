"""`TrainBackend` over megatron-core: tensor / expert parallel GPTModel shards, data parallel on top.

Each rank builds its shard of the model (milepost/train/megatron/provider.py) from the Hugging Face
directory. Ranks of one model-parallel group must be given the same samples: split a rollout with
`split_for_rank(samples, backend.data_rank, backend.data_world, ...)`. The loss path is the FSDP
backend's (milepost/train/micro.py, losses.py, corrections.py): packed micro-batches (block-causal
mask), the loss pre-divided by the global loss-token count, gradients summed over the data-parallel
group (experts: over their expert-data-parallel group), then clip and AdamW on each rank's shard.
The optimizer: torch AdamW on each rank's model shard, or with `--use-distributed-optimizer`
megatron-core's distributed optimizer (dist_optim.py: the same update, its Adam state sharded
over data parallel). Pipeline parallel (PP > 1) runs megatron's 1F1B schedule (pipeline.py); the
loss and scores come from the last stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from milepost.train import micro
from milepost.train.batch import TrainBatch
from milepost.train.corrections import (
    CORRECTION_SUMS,
    CorrectionSettings,
    sample_weights,
)
from milepost.train.export import write_hf_directory
from milepost.train.logprobs import plan_micro_batches
from milepost.train.losses import METRIC_SUMS, LossSettings, get_loss
from milepost.train.megatron import checkpoint as mckpt
from milepost.train.megatron.collectives import clip_gradients, full_megatron_state, sync_gradients
from milepost.train.megatron.convert import megatron_to_hf
from milepost.train.megatron.dist_optim import DistributedAdam
from milepost.train.megatron.parallel import ParallelSizes, validate_sizes
from milepost.train.megatron.pipeline import broadcast_scores, run_pipeline
from milepost.train.megatron.provider import (
    build_model,
    init_parallel,
    load_hf_into,
    read_hf_weights,
    require_megatron,
)
from milepost.train.megatron.scorer import MegatronScorer
from milepost.train.megatron.shape import ModelShape, shape_of
from milepost.train.optim import build_optimizer, optimizer_step
from milepost.train.replay import samples_routing
from milepost.train.settings import TrainerSettings
from milepost.types import Sample

# TrainerSettings features this backend does not have yet, each with the value that turns it off.
_NOT_YET = {
    "lora_rank": 0, "critic_lr": None, "true_on_policy": False,
    "opd_teacher_checkpoint": None, "optimizer_state_dir": None, "compile_layers": False,
    "activation_checkpointing": "none", "actor_critic_turns": False,
}


def refuse_unsupported(settings: TrainerSettings, sizes: ParallelSizes, shape: ModelShape) -> None:
    """Refuse, at start, settings the Megatron backend does not implement yet (naming each)."""
    for name, off in _NOT_YET.items():
        if getattr(settings, name) != off:
            raise ValueError(f"{name}={getattr(settings, name)!r} is not available with --train-backend megatron yet "
                             f"(set {name}={off!r} or use --train-backend fsdp)")
    if settings.precision != "bf16":  # would train bf16 while the engines expect the format
        raise ValueError(f"precision={settings.precision!r} with --train-backend megatron: the quantized "
                         "trainer is the FSDP backend's; use --train-backend fsdp or a bf16 trainer")
    if settings.use_rollout_routing_replay and not shape.is_moe:
        raise ValueError(f"--use-rollout-routing-replay: the model is a dense {shape.model_type} (no expert routing "
                         "to replay); turn it off or train a mixture-of-experts model")
    if settings.device == "cpu" and settings.dtype != "float32":
        raise ValueError(f"dtype={settings.dtype!r} on device='cpu' with --train-backend megatron: megatron's "
                         "linear layers run their backward outside CPU autocast (they re-enter CUDA's only) and "
                         "fail; train in float32 on the CPU, or on a GPU")
    if sizes.pp > 1 and settings.use_rollout_routing_replay:
        raise ValueError(f"--use-rollout-routing-replay with --pipeline-model-parallel-size {sizes.pp}: replaying "
                         "routes on pipeline stages is not wired yet; set --pipeline-model-parallel-size 1 or turn R3 off")
    if shape.is_moe and sizes.tp > 1 and settings.use_rollout_routing_replay:
        raise ValueError(f"--use-rollout-routing-replay with --tensor-model-parallel-size {sizes.tp} on a "
                         "mixture-of-experts model: replaying routes under sequence parallel is not wired yet; "
                         "use --expert-model-parallel-size without TP, or turn R3 off")


class MegatronBackend:
    """Build with `MegatronBackend.create(model_path, settings, sizes)` on every rank."""

    def __init__(self, model_path: Path, settings: TrainerSettings, sizes: ParallelSizes, shape: ModelShape,
                 device: torch.device, policy: Any, reference: Any | None) -> None:
        from megatron.core import parallel_state as ps

        self.model_path, self.settings, self.sizes, self.shape, self.device = model_path, settings, sizes, shape, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.data_rank, self.data_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.policy, self.reference = policy, reference
        self.critic = self.teacher = None  # not available on this backend (refused at start)
        self.offloaded = False
        # --use-distributed-optimizer: megatron's DDP buffers and DistributedOptimizer (Adam state 1/DP)
        self.dist_adam = DistributedAdam(policy, settings) if settings.use_distributed_optimizer else None
        if self.dist_adam is not None:
            self.optimizer, self.scheduler = self.dist_adam, self.dist_adam.schedules
        else:
            self.optimizer, self.scheduler = build_optimizer(list(policy.parameters()), settings)
        self.loss_fn = get_loss(settings.loss_type, settings.custom_loss_function_path)
        self.loss_settings = LossSettings(
            eps_clip=settings.eps_clip, eps_clip_high=settings.clip_high, ratio_level=settings.ratio_level,
            aggregation=settings.loss_aggregation, kl_loss_coef=settings.kl_loss_coef,
            kl_loss_type=settings.kl_loss_type, entropy_coef=settings.entropy_coef, value_clip=settings.value_clip)
        self.correction = CorrectionSettings(settings.ratio_correction, settings.tis_clip_low, settings.tis_clip)
        self._dp_group = ps.get_data_parallel_group()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._ep_group = ps.get_expert_model_parallel_group()
        self._edp_group = ps.get_expert_data_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._mp_group = ps.get_model_parallel_group()  # TP x PP: ranks that must see the same samples

    @classmethod
    def create(cls, model_path: str | Path, settings: TrainerSettings,
               sizes: ParallelSizes | None = None) -> MegatronBackend:
        """Collective: call on every rank after `dist.init_process_group` (gloo for cpu, nccl for cuda)."""
        require_megatron()
        if not dist.is_initialized():
            raise RuntimeError("MegatronBackend.create needs an initialized default process group")
        sizes = sizes or ParallelSizes()
        path = Path(model_path)
        shape = shape_of(json.loads((path / "config.json").read_text()))
        world = dist.get_world_size()
        validate_sizes(shape, sizes, world)
        refuse_unsupported(settings, sizes, shape)
        dp = sizes.data_parallel(world)
        if settings.global_batch_size % dp:
            raise ValueError(f"global_batch_size ({settings.global_batch_size}) must be a multiple of the data-parallel "
                             f"size {dp} (world {world} / (TP {sizes.tp} x PP {sizes.pp} x CP {sizes.cp}))")
        get_loss(settings.loss_type, settings.custom_loss_function_path)
        if settings.device == "cuda":
            device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        torch.manual_seed(settings.seed)
        init_parallel(sizes.tp, sizes.pp, sizes.ep, sizes.cp, seed=settings.seed)
        hf = read_hf_weights(path)
        dtype = settings.torch_dtype

        def load(trainable: bool) -> Any:
            model = build_model(shape, tp=sizes.tp, pp=sizes.pp, ep=sizes.ep, cp=sizes.cp, dtype=dtype,
                                routing_replay=settings.use_rollout_routing_replay)
            load_hf_into(model, shape, hf)
            return model.to(device).requires_grad_(trainable)

        policy = load(True)
        reference = load(False).eval() if settings.needs_reference else None
        return cls(path, settings, sizes, shape, device, policy, reference)

    # --- helpers ----------------------------------------------------------------------------------

    def _reduce(self, values: list[float], group: Any = None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self._dp_group if group is None else group)
        return t.tolist()

    def _plan(self, lengths: list[int]) -> list[list[int]]:
        local = plan_micro_batches(lengths, self.settings.max_tokens_per_micro_batch)
        count = int(self._reduce([len(local)], op=dist.ReduceOp.MAX)[0])
        return plan_micro_batches(lengths, self.settings.max_tokens_per_micro_batch, count)

    def _scorer(self, model: Any) -> MegatronScorer:
        pad_group = self._ep_group if self.sizes.ep > 1 else None
        sp = self.sizes.tp if self.shape.is_moe else 1  # sequence parallel (provider.transformer_config)
        return MegatronScorer(model, self.settings.temperature, self.settings.torch_dtype, pad_group, sp)

    def _require_onloaded(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"MegatronBackend.{what} called while offloaded; call onload() first")

    @torch.no_grad()
    def _score(self, model: Any, batch: TrainBatch, plan: list[list[int]]) -> list[torch.Tensor]:
        model.eval()
        out: list[torch.Tensor | None] = [None] * len(batch)
        if self.sizes.pp > 1:
            def keep(i: int, logits: torch.Tensor) -> None:
                logp, _ = scorer.finish(logits, packed[i])
                for j, x in zip(plan[i], logp.split([batch.response_lengths[j] for j in plan[i]])):
                    out[j] = x.float()
            scorer, packed = self._scorer(model), [micro.packed(batch, mb, self.device) for mb in plan]
            run_pipeline(scorer, packed, keep, forward_only=True)
            return broadcast_scores(out, batch.response_lengths, self.device)
        for mb in plan:
            logp, _ = self._scorer(model).score(micro.packed(batch, mb, self.device), *self._forced(batch, mb))
            for i, x in zip(mb, logp.split([batch.response_lengths[i] for i in mb])):
                out[i] = x.float().cpu()
        return out  # type: ignore[return-value]

    def compute_logprobs(self, samples: Sequence[Sample], *, reference: bool = False,
                         teacher: bool = False) -> list[torch.Tensor]:
        self._require_onloaded("compute_logprobs")
        if teacher:
            raise ValueError("compute_logprobs(teacher=True): no in-process teacher on --train-backend megatron")
        model = self.reference if reference else self.policy
        if model is None:
            raise ValueError("compute_logprobs(reference=True) needs a reference model: set use_kl_loss=True")
        resp = [s.response_length for s in samples]
        zeros = [torch.zeros(r) for r in resp]
        batch = TrainBatch([torch.as_tensor(s.tokens, dtype=torch.int64) for s in samples], resp, zeros, zeros,
                           routed_experts=self.routed_experts_of(samples))
        return self._score(model, batch, self._plan([t.numel() for t in batch.tokens]))

    def routed_experts_of(self, samples: Sequence[Sample]) -> list[torch.Tensor] | None:
        """The samples' engine routings decoded for this model (R3), or None when R3 is off."""
        if not self.settings.use_rollout_routing_replay:
            return None
        return samples_routing(samples, self.shape.num_layers, self.shape.moe_top_k)

    def _forced(self, batch: TrainBatch, mb: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        routed = batch.routed_experts if self.settings.use_rollout_routing_replay else None
        return micro.forced_experts(routed, mb, self.shape.num_layers, self.shape.moe_top_k, self.device)

    def take_turn_stats(self) -> None:
        return None  # actor/critic turns are refused on this backend

    # --- training ----------------------------------------------------------------------------------

    def _steps(self, batch: TrainBatch) -> list[list[int]]:
        per_rank = self.settings.global_batch_size // self.data_world
        sizes = [0] * self.world_size
        dist.all_gather_object(sizes, len(batch))
        if len(set(sizes)) > 1 or sizes[0] == 0 or sizes[0] % per_rank:
            raise ValueError(f"train_step needs the same non-zero multiple of global_batch_size / data-parallel size "
                             f"= {per_rank} samples on every rank, got {sizes} per rank; split the rollout with "
                             "split_for_rank(samples, backend.data_rank, backend.data_world, ...)")
        if self.sizes.tp * self.sizes.pp > 1:  # TP peers and PP stages must see the same samples
            mine = (len(batch), [int(t.sum()) for t in batch.tokens])
            peers: list = [None] * (self.sizes.tp * self.sizes.pp)
            dist.all_gather_object(peers, mine, group=self._mp_group)
            if any(p != mine for p in peers):
                raise ValueError("the ranks of one tensor/pipeline-parallel group were given different samples; split "
                                 "the rollout with split_for_rank(samples, backend.data_rank, backend.data_world, ...)")
        return [list(range(i, i + per_rank)) for i in range(0, len(batch), per_rank)]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self._require_onloaded("train_step")
        if batch.returns is not None:
            raise ValueError("TrainBatch.returns: a critic is not available on --train-backend megatron yet")
        if self.settings.use_rollout_routing_replay and batch.routed_experts is None:
            raise ValueError("--use-rollout-routing-replay: TrainBatch.routed_experts is missing")
        steps = self._steps(batch)
        plans = [self._plan([batch.tokens[i].numel() for i in step]) for step in steps]
        denoms = [self._reduce([float(sum(batch.loss_masks[i].sum() for i in step)),
                                float(sum(bool((batch.loss_masks[i] > 0).any()) for i in step))]) for step in steps]
        old = batch.old_logprobs
        if old is None and self.settings.loss_type != "sft_loss":
            old = [torch.empty(0)] * len(batch)  # the policy before this rollout's first optimizer step
            for step, plan in zip(steps, plans):
                for i, lp in zip(step, self._score(self.policy, batch.select(step), plan)):
                    old[i] = lp
        ref = batch.ref_logprobs
        if ref is None and self.reference is not None:
            ref = self._score(self.reference, batch, self._plan([t.numel() for t in batch.tokens]))
        weights, correction_sums = sample_weights(old, batch.rollout_logprobs, batch.loss_masks, self.correction)
        acc = torch.zeros(len(METRIC_SUMS) + 1, dtype=torch.float64, device=self.device)
        r3 = [0.0, 0.0]  # rows with a rollout routing, of which the natural routing differs
        loss_tokens, grad_norms, nonfinite = 0.0, [], 0
        lr = self.optimizer.param_groups[0]["lr"]
        self.policy.train()
        for step, plan, denom in zip(steps, plans, denoms):
            loss_tokens += denom[0]
            if self.sizes.pp > 1:
                acc += self._pipeline_step(batch, [[step[j] for j in local] for local in plan], old, ref, weights, denom)
            else:
                for local in plan:
                    acc += self._micro_step(batch, [step[j] for j in local], old, ref, weights, denom, r3)
            sync_gradients(self)
            lr = self.optimizer.param_groups[0]["lr"]
            if self.dist_adam is not None:
                norm, skipped = self.dist_adam.step(self.settings.clip_grad)
                grad_norms.append(norm)
                nonfinite += skipped
            else:
                grad_norms.append(clip_gradients(self, self.settings.clip_grad))
                nonfinite += optimizer_step(self.optimizer, self.scheduler, grad_norms[-1])
        abs_diff = 0.0
        if batch.rollout_logprobs is not None and old is not None:
            for o, r, m in zip(old, batch.rollout_logprobs, batch.loss_masks):
                abs_diff += float((o - r).abs()[m > 0].sum())
        n_tokens = float(sum(t.numel() for t in batch.tokens))
        if self.sizes.pp > 1:  # the loss sums exist on the last stage only
            dist.all_reduce(acc, group=self._pp_group)
        reduced = self._reduce(acc.tolist() + list(correction_sums) + r3 + [abs_diff, n_tokens])
        per_token, n = max(loss_tokens, 1.0), len(METRIC_SUMS)
        metrics = {k: v / per_token for k, v in zip(METRIC_SUMS, reduced)}
        if self.settings.loss_type != "sft_loss":
            metrics.pop("sft_loss")
        metrics.update(loss=reduced[n] / len(steps), grad_norm=sum(grad_norms) / len(steps), lr=lr,
                       tokens=reduced[-1], loss_tokens=loss_tokens, optimizer_steps=float(len(steps)),
                       skipped_steps=float(nonfinite))
        if self.correction.kind != "none":
            metrics.update({k: v / per_token for k, v in zip(CORRECTION_SUMS, reduced[n + 1:n + 1 + len(CORRECTION_SUMS)])})
        if self.settings.use_rollout_routing_replay:
            metrics["r3_routing_mismatch_frac"] = reduced[-3] / max(reduced[-4], 1.0)
        if batch.rollout_logprobs is not None and old is not None:
            metrics["train_rollout_logprob_abs_diff"] = reduced[-2] / per_token
        return metrics

    def _loss(self, batch: TrainBatch, mb: list[int], logp: torch.Tensor, entropy: torch.Tensor, old, ref, weights,
              denoms) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss and its [metric sums..., loss] row (float64)."""
        lb = micro.loss_batch(batch, mb, logp, entropy, denoms, self.device, old=old, ref=ref, weights=weights)
        loss, sums = self.loss_fn(lb, self.loss_settings)
        unknown = set(sums) - set(METRIC_SUMS)
        if unknown:
            raise ValueError(f"the loss returned metric sums {sorted(unknown)}; allowed: {METRIC_SUMS}")
        zero = torch.zeros((), device=self.device)
        row = torch.stack([*(sums.get(k, zero).detach().to(self.device) for k in METRIC_SUMS), loss.detach()])
        return loss, row.double()

    def _micro_step(self, batch: TrainBatch, mb: list[int], old, ref, weights, denoms, r3: list[float]) -> torch.Tensor:
        scorer = self._scorer(self.policy)
        logp, entropy = scorer.score(micro.packed(batch, mb, self.device), *self._forced(batch, mb))
        r3[0] += scorer.r3[0]
        r3[1] += scorer.r3[1]
        loss, row = self._loss(batch, mb, logp, entropy, old, ref, weights, denoms)
        loss.backward()
        return row

    def _pipeline_step(self, batch: TrainBatch, mbs: list[list[int]], old, ref, weights, denoms) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches through the 1F1B schedule;
        the metric and loss sums (non-zero on the last stage only)."""
        scorer = self._scorer(self.policy)
        packed = [micro.packed(batch, mb, self.device) for mb in mbs]
        rows: list[torch.Tensor] = []

        def loss_of(i: int, logits: torch.Tensor) -> torch.Tensor:
            loss, row = self._loss(batch, mbs[i], *scorer.finish(logits, packed[i]), old, ref, weights, denoms)
            rows.append(row)
            return loss

        run_pipeline(scorer, packed, loss_of, forward_only=False)
        return sum(rows, torch.zeros(len(METRIC_SUMS) + 1, dtype=torch.float64, device=self.device))

    # --- weights, checkpoints, export --------------------------------------------------------------

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_onloaded("named_hf_weights")
        dtype = self.settings.torch_dtype
        for name, t in megatron_to_hf(self.shape, full_megatron_state(self)).items():
            yield name, t.to(self.device, dtype)

    def _layout(self) -> dict[str, int]:
        layout = {"tp": self.sizes.tp, "pp": self.sizes.pp, "ep": self.sizes.ep, "cp": self.sizes.cp}
        if self.dist_adam is not None:  # per-rank Adam shards: resume with the same setting and sizes
            layout["use_distributed_optimizer"] = 1
        return layout

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self._require_onloaded("save_checkpoint")
        mckpt.save(path, self.policy, self.optimizer, self.scheduler, self._layout(), extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        self._require_onloaded("load_checkpoint")
        return mckpt.load(path, self.policy, self.optimizer, self.scheduler, self._layout())

    def export_hf(self, path: str | Path) -> None:
        write_hf_directory(self.named_hf_weights(), self.model_path, path)

    # --- offload -----------------------------------------------------------------------------------

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """The Adam moments this rank holds (with the distributed optimizer: its 1/DP shards)."""
        if self.dist_adam is not None:
            return self.dist_adam.state_tensors()
        return [v for st in self.optimizer.state.values() for k, v in st.items()
                if isinstance(v, torch.Tensor) and k != "step"]

    def device_tensors(self) -> list[torch.Tensor]:
        """What `offload` moves: weights, gradients, Adam state, the reference model."""
        ref = list(self.reference.parameters()) if self.reference is not None else []
        if self.dist_adam is not None:
            return self.dist_adam.device_tensors() + ref
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return [*self.policy.parameters(), *grads, *ref, *self.optimizer_state_tensors()]

    def _move(self, device: torch.device) -> None:
        if self.dist_adam is not None:  # weights live in DDP's buffers: megatron's buffer offload
            self.dist_adam.move(device)
            if self.reference is not None:
                self.reference.to(device)
            return
        for model in (self.policy, self.reference):
            if model is not None:
                model.to(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(device)

    def offload(self) -> None:
        """Move weights and Adam state to host memory (a no-op move on CPU); returns no stats yet."""
        if not self.offloaded:
            self._move(torch.device("cpu"))
            self.offloaded = True

    def onload(self) -> None:
        if self.offloaded:
            self._move(self.device)
            self.offloaded = False
