"""PPO with --offload-actor-for-critic on real gloo ranks (issue 9, report 3.2): the actor (policy,
reference, optimizer) is off the device whenever the critic computes or trains and the other way
round, and training is bitwise the same as with both always resident."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

BASE = dict(lr=1e-3, critic_lr=1e-2, global_batch_size=4, max_tokens_per_micro_batch=40,
            use_kl_loss=True, kl_loss_coef=0.05)


def local(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def evicted(modules: list[torch.nn.Module]) -> bool:
    """Every parameter shard of `modules` has a zero-byte storage."""
    return all((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() == 0
               for m in modules for p in m.parameters())


def ppo_steps(backend: FSDPBackend, rank: int, world: int, offload: bool) -> dict:
    seen: dict[str, list[bool]] = {"critic_forward_actor_out": [], "actor_forward_critic_out": []}
    actor = [backend.policy, backend.reference]
    backend.critic.model.register_forward_pre_hook(
        lambda *_: seen["critic_forward_actor_out"].append(evicted(actor)))
    backend.policy.register_forward_pre_hook(
        lambda *_: seen["actor_forward_critic_out"].append(evicted([backend.critic.model])))
    metrics, turns = [], []
    for seed in (1, 2, 3):
        if offload and seed > 1:
            backend.onload()
            # nothing comes back before it is used: the step starts with the critic's values
            assert evicted(actor) and evicted([backend.critic.model])
        full = random_train_batch(8, seed)
        batch = full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))
        samples = [Sample(0, i, tokens=t.tolist(), response_length=r)
                   for i, (t, r) in enumerate(zip(batch.tokens, batch.response_lengths))]
        batch.values = backend.compute_values(samples)
        batch.returns = [v + 0.5 * a for v, a in zip(batch.values, batch.advantages)]
        metrics.append(backend.train_step(batch))
        dict(backend.named_hf_weights())  # the weight update reads the actor after the step
        if offload:
            backend.offload()
            assert evicted(actor) and evicted([backend.critic.model])
        turns.append(backend.take_turn_stats())
    if offload:
        backend.onload()
    backend.residency.use("critic")  # with turns, each model comes back when used
    critic = local(backend.critic.model)
    backend.residency.use("actor")
    return {"policy": local(backend.policy), "critic": critic, "metrics": metrics,
            "seen": seen, "turns": turns}


def worker(rank: int, world: int, path: str, tmp: str) -> dict[str, dict]:
    out = {}
    for name, extra, offload in [
        ("resident", {}, False),
        ("turns to host", {"actor_critic_turns": True}, True),
        ("turns to disk", {"actor_critic_turns": True, "offload_destination": "disk",
                           "offload_dir": f"{tmp}/offload", "offload_staging_bytes": 1000}, True),
    ]:
        backend = FSDPBackend.create(path, TrainerSettings(**BASE, **extra))
        out[name] = ppo_steps(backend, rank, world, offload)
        if name == "turns to disk":  # a checkpoint needs both models: each comes in for its part
            backend.offload()
            backend.onload()
            backend.save_checkpoint(f"{tmp}/ckpt", extra={"step": 2})
            fresh = FSDPBackend.create(path, TrainerSettings(**BASE, **extra))
            fresh.load_checkpoint(f"{tmp}/ckpt")
            fresh.residency.use("critic")
            critic = local(fresh.critic.model)
            fresh.residency.use("actor")
            out["reloaded"] = {"policy": local(fresh.policy), "critic": critic}
    return out


def test_actor_and_critic_take_turns_and_train_bitwise_the_same(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False)
    for ranks in run_ranks(worker, 2, str(path), str(tmp_path), timeout_s=240):
        plain = ranks["resident"]
        # the control: without turns both models are on the device whenever either runs
        assert not any(plain["seen"]["critic_forward_actor_out"] + plain["seen"]["actor_forward_critic_out"])
        assert plain["turns"] == [None, None, None]
        for name in ("turns to host", "turns to disk"):
            r = ranks[name]
            assert r["metrics"] == plain["metrics"], name
            for model in ("policy", "critic"):
                assert all(torch.equal(plain[model][k], r[model][k]) for k in plain[model]), (name, model)
            for key, flags in r["seen"].items():
                assert flags and all(flags), (name, key)  # every forward, values and training alike
            # per step: critic in (values, training), critic out + actor in, actor out at offload
            assert all(t.bytes > 0 and t.seconds > 0 for t in r["turns"]), (name, r["turns"])
        assert "value_loss" in plain["metrics"][0]
        for model in ("policy", "critic"):
            saved, back = ranks["turns to disk"][model], ranks["reloaded"][model]
            assert all(torch.equal(saved[k], back[k]) for k in saved), model
