"""The PPO critic, colocated with the actor: a value model trained by the same ranks.

`ValueModel` is the native LM's decoder (loaded from a Hugging Face directory, by default the
policy's) with a scalar head on the hidden state that predicts each response token: V(s_t) for
the state before response token t. It is sharded with FSDP2 over the actor's mesh and has its own
AdamW (lr = critic_lr, same schedule shape as the actor's). Its checkpoint sits beside the actor's
(`<step dir>.critic`), written before the actor's, so a complete actor checkpoint has its critic.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext
from milepost.models.registry import load_model
from milepost.train import checkpoint as ckpt
from milepost.train.logprobs import PackedBatch
from milepost.train.optim import build_optimizer
from milepost.train.settings import TrainerSettings


class ValueModel(nn.Module):
    """Decoder + `value_head` (hidden -> 1, zero-initialized so the first values are 0)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.hf_config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        rows: torch.Tensor,
        forced_experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed batch fields -> values [N] fp32 at the rows that predict response tokens."""
        ctx = ForwardContext(VarlenCausalAttention(cu_seqlens), forced_experts=forced_experts)
        hidden = self.lm(input_ids, positions, ctx)
        return self.value_head(hidden.index_select(0, rows)).float().sum(-1)  # [N, 1] -> [N], a new tensor (no view)

    def values(self, batch: PackedBatch, forced: torch.Tensor | None = None) -> torch.Tensor:
        return self(batch.input_ids, batch.positions, batch.cu_seqlens, batch.rows, forced)


def critic_path(actor_checkpoint: str | Path) -> Path:
    p = Path(actor_checkpoint)
    return p.parent / f"{p.name}.critic"


class Critic:
    """The value model, its optimizer and schedule; every method is a collective like the backend's."""

    def __init__(self, model_path: Path, s: TrainerSettings, device: torch.device) -> None:
        lm = load_model(Path(s.critic_hf_checkpoint or model_path), torch.float32, "cpu")
        self.model = ValueModel(lm)
        mp = MixedPrecisionPolicy(param_dtype=s.torch_dtype, reduce_dtype=torch.float32)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in lm.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)
        for m in self.fsdp_modules():
            m.set_gradient_divide_factor(1.0)  # losses are pre-divided by the global count
            m.set_force_sum_reduction_for_comms(True)
        self.settings = dataclasses.replace(s, lr=s.critic_lr, min_lr=min(s.min_lr, s.critic_lr))
        # The LM head is not used by the critic: keep it out of the optimizer (it gets no gradient).
        params = [p for n, p in self.model.named_parameters() if not n.startswith("lm.lm_head")]
        self.optimizer, self.scheduler = build_optimizer(params, self.settings)

    def fsdp_modules(self) -> list[FSDPModule]:
        return [m for m in self.model.modules() if isinstance(m, FSDPModule)]

    def reshard(self) -> None:
        for m in self.fsdp_modules():
            m.reshard()

    def save(self, actor_checkpoint: str | Path) -> None:
        ckpt.save_checkpoint(critic_path(actor_checkpoint), self.model, self.optimizer, self.scheduler, {})

    def load(self, actor_checkpoint: str | Path) -> None:
        path = critic_path(actor_checkpoint)
        if not path.is_dir():
            raise FileNotFoundError(f"{actor_checkpoint} has no critic checkpoint beside it ({path}); "
                                    "it was saved by a run without a critic (--critic-lr)")
        ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler)

    def to(self, device: torch.device) -> None:
        self.reshard()
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(device)
