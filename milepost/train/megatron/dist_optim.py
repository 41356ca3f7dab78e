"""Megatron's distributed optimizer (`--use-distributed-optimizer`): Adam state sharded over data parallel.

The policy is wrapped in megatron-core's `DistributedDataParallel` (contiguous fp32 parameter and
gradient buffers; gradients reduce-scattered over the data-parallel group, experts over their
expert-data-parallel group) and stepped by megatron's `DistributedOptimizer`: torch AdamW on this
rank's 1/DP shard of every buffer, then the updated shards all-gathered into every rank's weights.
Ours, not megatron's: the grad norm, clip and non-finite skip (the AdamW path's rule, on the
shards; megatron's clip asserts CUDA tensors), the learning-rate schedule (`lr_at`, one LambdaLR per
inner optimizer: dense and experts), and weight decay on every weight as with AdamW
(`config_overrides={}`: megatron's default exempts biases and 1-D weights).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from milepost.train.megatron.cpu_shim import cpu_tensors_named_as_cuda, install_cpu_optimizer_shim
from milepost.train.optim import lr_at
from milepost.train.settings import TrainerSettings


class Schedules:
    """`lr_at` on each inner optimizer, saved and restored like one LambdaLR."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], s: TrainerSettings) -> None:
        base = s.lr if s.lr > 0 else 1.0  # as in build_optimizer: LambdaLR multiplies the base lr
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = base
        self.schedules = [LambdaLR(opt, lambda step: lr_at(step, s) / base) for opt in optimizers]

    def step(self) -> None:
        for schedule in self.schedules:
            schedule.step()

    def state_dict(self) -> list[dict]:
        return [schedule.state_dict() for schedule in self.schedules]

    def load_state_dict(self, states: list[dict]) -> None:
        for schedule, state in zip(self.schedules, states, strict=True):
            schedule.load_state_dict(state)


class DistributedAdam:
    """The policy's DDP wrapper and megatron's distributed optimizer over it (collective to build).

    Per optimizer step: gradients accumulate in `p.main_grad` (DDP's hooks; `p.grad` stays None),
    then `reduce_scatter()`, then `step(clip)`."""

    def __init__(self, policy: Any, s: TrainerSettings) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        install_cpu_optimizer_shim()
        self.device = next(policy.parameters()).device
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=False, overlap_param_gather=False)
        # calculate_per_token_loss (set by provider.transformer_config): DDP sums, no 1/DP scaling
        self.ddp = DistributedDataParallel(copy.copy(policy.config), ddp_config, policy)
        config = OptimizerConfig(optimizer="adam", lr=s.lr, min_lr=s.min_lr, weight_decay=s.weight_decay,
                                 adam_beta1=s.adam_beta1, adam_beta2=s.adam_beta2, adam_eps=s.adam_eps,
                                 clip_grad=0.0, use_distributed_optimizer=True, params_dtype=torch.float32)
        with cpu_tensors_named_as_cuda():  # its parameter-type checks name CUDA types only
            self.megatron = get_megatron_optimizer(config, [self.ddp], config_overrides={},
                                                   use_gloo_process_groups=False)
        self.parts = [o for o in self.megatron.chained_optimizers if not getattr(o, "is_stub_optimizer", False)]
        self.inner: list[torch.optim.Optimizer] = [o.optimizer for o in self.parts]
        groups = {o.get_grad_stats_parallel_group() for o in self.parts}
        if len(groups) != 1:
            raise RuntimeError("megatron's dense and expert optimizers reduce grad stats over different groups")
        self._stats_group = groups.pop()
        self.schedules = Schedules(self.inner, s)

    @property
    def param_groups(self) -> list[dict]:
        """The dense optimizer's groups (their lr is the one the metrics report)."""
        return self.inner[0].param_groups

    def buffers(self) -> list[Any]:
        return self.ddp.buffers + self.ddp.expert_parallel_buffers

    def reduce_scatter(self) -> None:
        """Sum each rank's `main_grad` over data parallel: after it, this rank's shard is complete."""
        self.ddp.finish_grad_sync()

    def step(self, clip: float) -> tuple[float, int]:
        """Grad norm (each weight once over DP shards, TP copies and EP), torch's clip rule, then the
        update of this rank's shards and their all-gather; skipped when the norm is not finite.
        Returns (grad norm, 1 if skipped else 0); gradients are zero after."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        self.megatron.prepare_grads()  # shard.grad = this rank's slice of main_grad
        shards = [p for part in self.parts for p in part.get_parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in shards:
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self._stats_group)
        norm = float(squares.sqrt())
        skipped = 0 if math.isfinite(norm) else 1
        if not skipped:
            coef = clip / (norm + 1e-6)
            if clip > 0 and coef < 1.0:
                for p in shards:
                    p.grad.mul_(coef)
            self.megatron.step_with_ready_grads()
        self.schedules.step()
        self.zero_grad()
        return norm, skipped

    def zero_grad(self) -> None:
        self.megatron.zero_grad(set_to_none=True)
        self.ddp.zero_grad_buffer()

    def state_dict(self) -> dict:
        """This rank's shards of the Adam state (per inner optimizer): a per-rank checkpoint."""
        return {"distributed_optimizer": [o.state_dict() for o in self.inner]}

    def load_state_dict(self, state: dict) -> None:
        if "distributed_optimizer" not in state:
            raise ValueError("the checkpoint's optimizer state is not the distributed optimizer's: resume with "
                             "the --use-distributed-optimizer setting it was saved with")
        for opt, own in zip(self.inner, state["distributed_optimizer"], strict=True):
            opt.load_state_dict(own)

    def state_tensors(self) -> list[torch.Tensor]:
        """The Adam moments this rank holds (its shards)."""
        return [v for opt in self.inner for st in opt.state.values() for k, v in st.items()
                if isinstance(v, torch.Tensor) and k != "step"]

    def device_tensors(self) -> list[torch.Tensor]:
        """Everything offload moves: the parameter and gradient buffers and the Adam moments."""
        out = [t for b in self.buffers() for t in (b.param_data, b.grad_data) if t is not None]
        return out + self.state_tensors()

    def move(self, device: torch.device) -> None:
        """Buffers to host memory (megatron's own offload: storage freed, views kept) or back, and the
        Adam moments with them. A no-op on the CPU."""
        if device.type == "cpu" and all(t.device.type == "cpu" for t in self.device_tensors()):
            return
        for b in self.buffers():
            if device.type == "cpu":
                b.offload_to_cpu(move_params=True, move_grads=True)
            else:
                b.reload_from_cpu(move_params=True, move_grads=True)
        for opt in self.inner:
            for st in opt.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        st[k] = v.to(device)
