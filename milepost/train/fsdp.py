"""FSDP2 training backend: a Hugging Face directory loaded as-is into the native model, sharded.

Every rank of the default process group (gloo on CPU, NCCL on GPU) loads the checkpoint with
`load_model`, then `fully_shard`s each decoder layer and the root (`TokenScorer`, which owns the LM
head so its chunked log-prob pass runs inside the root forward). Pure data parallel: each rank trains
on the samples it is given; gradients are summed across ranks and the loss is pre-divided by the
global loss-token count. Master weights and AdamW state are fp32; `dtype` only sets compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from milepost.models.registry import load_model
from milepost.train import checkpoint as ckpt
from milepost.train.batch import TrainBatch, split_for_rank
from milepost.train.export import write_hf_directory
from milepost.train.logprobs import TokenScorer, dummy_batch, pack, plan_micro_batches
from milepost.train.losses import METRIC_SUMS, PolicyLossSettings, policy_loss
from milepost.train.optim import build_optimizer
from milepost.train.settings import TrainerSettings
from milepost.types import Sample

__all__ = ["FSDPBackend", "TrainerSettings", "split_for_rank"]


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _shard(model_path: Path, s: TrainerSettings, device: torch.device, trainable: bool) -> TokenScorer:
    lm = load_model(model_path, torch.float32, "cpu")  # fp32 master weights; fully_shard moves each shard
    scorer = TokenScorer(lm, s.temperature, s.logprob_chunk_size)
    mp = MixedPrecisionPolicy(param_dtype=s.torch_dtype, reduce_dtype=torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(scorer, mesh=mesh, mp_policy=mp)
    for m in _fsdp_modules(scorer):
        # Sum, not average, across ranks: each rank's loss is already divided by the global token count.
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    scorer.requires_grad_(trainable)
    return scorer


class FSDPBackend:
    """`TrainBackend` over FSDP2. Build with `FSDPBackend.create(model_path, settings)` on every rank."""

    def __init__(
        self,
        model_path: Path,
        settings: TrainerSettings,
        device: torch.device,
        policy: TokenScorer,
        reference: TokenScorer | None,
    ) -> None:
        self.model_path = model_path
        self.settings = settings
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.policy = policy
        self.reference = reference
        self.optimizer, self.scheduler = build_optimizer(policy.parameters(), settings)
        self.loss_settings = PolicyLossSettings(
            eps_clip=settings.eps_clip,
            eps_clip_high=settings.clip_high,
            kl_loss_coef=settings.kl_loss_coef,
            kl_loss_type=settings.kl_loss_type,
            entropy_coef=settings.entropy_coef,
        )
        self._offloaded = False

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
        _seed_everything(settings.seed)
        path = Path(model_path)
        policy = _shard(path, settings, device, trainable=True)
        reference = _shard(path, settings, device, trainable=False) if settings.use_kl_loss else None
        return cls(path, settings, device, policy, reference)

    # --- collectives helpers -----------------------------------------------------------------------

    def _all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _aligned_plan(self, lengths: list[int]) -> list[list[int]]:
        """Micro-batches of these samples, as many as the busiest rank has (collective)."""
        local = plan_micro_batches(lengths, self.settings.max_tokens_per_micro_batch)
        count = int(self._all_reduce([len(local)], dist.ReduceOp.MAX)[0])
        return plan_micro_batches(lengths, self.settings.max_tokens_per_micro_batch, count)

    def _require_onloaded(self, what: str) -> None:
        if self._offloaded:
            raise RuntimeError(f"FSDPBackend.{what} called while offloaded; call onload() first")

    # --- log-probs -------------------------------------------------------------------------------

    @torch.no_grad()
    def _score(
        self, module: TokenScorer, tokens: list[torch.Tensor], resp: list[int], plan: list[list[int]]
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(tokens)
        for mb in plan:
            batch = pack([tokens[i] for i in mb], [resp[i] for i in mb], self.device) if mb else dummy_batch(self.device)
            logp, _ = module.score(batch)
            for i, lp in zip(mb, logp.split([resp[i] for i in mb])):
                out[i] = lp.float().cpu()
        for m in _fsdp_modules(module):
            m.reshard()  # no-grad forwards leave the root unsharded; keep the registered params sharded
        return out  # type: ignore[return-value]

    def compute_logprobs(self, samples: Sequence[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        self._require_onloaded("compute_logprobs")
        module = self.reference if reference else self.policy
        if module is None:
            raise ValueError("compute_logprobs(reference=True) needs a reference model: set use_kl_loss=True")
        tokens = [torch.as_tensor(s.tokens, dtype=torch.int64) for s in samples]
        resp = [s.response_length for s in samples]
        return self._score(module, tokens, resp, self._aligned_plan([len(t) for t in tokens]))

    # --- training --------------------------------------------------------------------------------

    def _steps(self, batch: TrainBatch) -> list[list[int]]:
        """Optimizer steps as local index lists, after checking that all ranks agree on the batch shape.

        The optional fields decide which collectives run (old/ref log-prob passes), so a rank that
        has them while a peer has not would hang both: refuse it instead, naming the field.
        """
        per_rank = self.settings.global_batch_size // self.world_size
        optional = ("rollout_logprobs", "old_logprobs", "ref_logprobs")
        mine = [len(batch)] + [getattr(batch, f) is not None for f in optional]
        local = torch.tensor(mine, dtype=torch.int64, device=self.device)
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        rows = [g.tolist() for g in gathered]
        sizes = [r[0] for r in rows]
        if len(set(sizes)) > 1 or sizes[0] == 0 or sizes[0] % per_rank:
            raise ValueError(
                f"train_step needs the same non-zero multiple of global_batch_size / world_size = {per_rank} "
                f"samples on every rank, got {sizes} per rank; split the rollout with split_for_rank"
            )
        for j, field in enumerate(optional, start=1):
            if len({r[j] for r in rows}) > 1:
                raise ValueError(
                    f"TrainBatch.{field} is set on ranks {[i for i, r in enumerate(rows) if r[j]]} only; "
                    "every rank must give it or none (e.g. rollout log-probs missing from some samples)"
                )
        return [list(range(i, i + per_rank)) for i in range(0, len(batch), per_rank)]

    def _micro_inputs(self, batch: TrainBatch, mb: list[int], old, ref) -> dict[str, torch.Tensor | None]:
        def cat(values: list[torch.Tensor] | None) -> torch.Tensor | None:
            if values is None:
                return None
            return torch.cat([values[i] for i in mb]).to(self.device, torch.float32) if mb else torch.zeros(1, device=self.device)

        return {
            "old_logp": cat(old),
            "advantages": cat(batch.advantages),
            "loss_mask": cat(batch.loss_masks),  # zeros for a dummy micro-batch: it only keeps collectives aligned
            "ref_logp": cat(ref),
        }

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self._require_onloaded("train_step")
        steps = self._steps(batch)
        plans = [self._aligned_plan([batch.tokens[i].numel() for i in step]) for step in steps]
        old = batch.old_logprobs
        if old is None:  # behaviour policy = the weights before this rollout's first optimizer step
            old = [torch.empty(0)] * len(batch)
            for step, plan in zip(steps, plans):
                tokens, resp = [batch.tokens[i] for i in step], [batch.response_lengths[i] for i in step]
                for i, lp in zip(step, self._score(self.policy, tokens, resp, plan)):
                    old[i] = lp
        ref = batch.ref_logprobs
        if ref is None and self.reference is not None:
            ref = self.compute_logprobs_of(batch, self.reference)

        # Per-rank sums on the device (one host sync per optimizer step, for the grad norm).
        acc = torch.zeros(len(METRIC_SUMS) + 1, dtype=torch.float64, device=self.device)  # metric sums, loss
        loss_tokens, grad_norms, nonfinite = 0.0, [], 0
        lr = self.optimizer.param_groups[0]["lr"]
        for step, plan in zip(steps, plans):
            denom = self._all_reduce([float(sum(batch.loss_masks[i].sum() for i in step))])[0]
            loss_tokens += denom
            for local in plan:
                acc += self._micro_step(batch, [step[j] for j in local], old, ref, max(denom, 1.0))
            grad_norms.append(self._clip_gradients())
            lr = self.optimizer.param_groups[0]["lr"]
            if math.isfinite(grad_norms[-1]):
                self.optimizer.step()
            else:  # a nan/inf gradient would poison the weights and Adam's moments: skip the update
                nonfinite += 1
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

        abs_diff = 0.0
        if batch.rollout_logprobs is not None:
            for o, r, m in zip(old, batch.rollout_logprobs, batch.loss_masks):
                abs_diff += float((o - r).abs()[m > 0].sum())
        n_tokens = float(sum(t.numel() for t in batch.tokens))
        reduced = self._all_reduce(acc.tolist() + [abs_diff, n_tokens])
        per_token = max(loss_tokens, 1.0)
        metrics = {k: v / per_token for k, v in zip(METRIC_SUMS, reduced)}
        metrics.update(
            loss=reduced[len(METRIC_SUMS)] / len(steps),
            grad_norm=sum(grad_norms) / len(steps),
            lr=lr,
            tokens=reduced[-1],
            loss_tokens=loss_tokens,
            optimizer_steps=float(len(steps)),
            skipped_steps=float(nonfinite),
        )
        if batch.rollout_logprobs is not None:
            metrics["train_rollout_logprob_abs_diff"] = reduced[-2] / per_token
        return metrics

    def _micro_step(self, batch: TrainBatch, mb: list[int], old, ref, denom: float) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns [metric sums..., loss] (float64, detached)."""
        resp = batch.response_lengths
        packed = pack([batch.tokens[i] for i in mb], [resp[i] for i in mb], self.device) if mb else dummy_batch(self.device)
        logp, entropy = self.policy.score(packed)
        loss, sums = policy_loss(logp, entropy, denom=denom, settings=self.loss_settings, **self._micro_inputs(batch, mb, old, ref))
        loss.backward()
        return torch.stack([*(sums[k] for k in METRIC_SUMS), loss.detach()]).double()

    def compute_logprobs_of(self, batch: TrainBatch, module: TokenScorer) -> list[torch.Tensor]:
        """Log-probs of a TrainBatch's responses under `module` (policy or reference), per sample on CPU."""
        plan = self._aligned_plan([t.numel() for t in batch.tokens])
        return self._score(module, batch.tokens, batch.response_lengths, plan)

    def _clip_gradients(self) -> float:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.settings.clip_grad if self.settings.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    # --- weights, checkpoints, export ------------------------------------------------------------

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_onloaded("named_hf_weights")
        lm = self.policy.lm
        dtype = self.settings.torch_dtype
        with torch.no_grad():
            for name, param in lm.named_parameters():
                full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                local = param.to_local() if isinstance(param, DTensor) else param
                if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                    full = full.clone()  # never hand out the live parameter: training would change it
                yield from lm.hf_tensors(name, full.to(dtype))

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self._require_onloaded("save_checkpoint")
        ckpt.save_checkpoint(path, self.policy, self.optimizer, self.scheduler, extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        self._require_onloaded("load_checkpoint")
        return ckpt.load_checkpoint(path, self.policy, self.optimizer, self.scheduler)

    def export_hf(self, path: str | Path) -> None:
        write_hf_directory(self.named_hf_weights(), self.model_path, path)

    # --- offload ---------------------------------------------------------------------------------

    def _move(self, device: torch.device) -> None:
        for module in (self.policy, self.reference):
            if module is not None:
                for m in _fsdp_modules(module):
                    m.reshard()
                module.to(device)  # FSDP2's _apply re-registers the sharded params (and moves grads)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":  # AdamW keeps `step` on CPU by design
                    state[key] = value.to(device)
        if device.type == "cpu" and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload(self) -> None:
        if not self._offloaded:
            self._move(torch.device("cpu"))
            self._offloaded = True

    def onload(self) -> None:
        if self._offloaded:
            self._move(self.device)
            self._offloaded = False
