"""The FSDP backend with the objective's extras on real gloo ranks: the PPO critic (values, value
loss, checkpoint), TIS metrics against hand values, GSPO and the driver's advantage plumbing."""

from __future__ import annotations

import math

import pytest
import torch

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample


def probe_samples() -> list[Sample]:
    return [Sample(0, i, tokens=list(range(3 + i, 12 + 2 * i)), response_length=3 + i, reward=float(i % 2))
            for i in range(4)]


def critic_worker(rank: int, world: int, path: str, ckpt: str) -> dict:
    s = TrainerSettings(lr=1e-3, critic_lr=1e-2, global_batch_size=4, max_tokens_per_micro_batch=32,
                        ratio_correction="tis", tis_clip_low=0.05, tis_clip=1.5)
    backend = FSDPBackend.create(path, s)
    samples = probe_samples()
    mine = split_for_rank(samples, rank, world, 4)
    local = [samples[i] for i in mine]
    v0 = backend.compute_values(local)
    batch = random_train_batch(4, seed=3).select(split_for_rank([12, 12, 12, 12], rank, world, 4))
    old = backend.compute_logprobs_of(batch, backend.policy)
    batch.values = [torch.zeros(r) for r in batch.response_lengths]
    batch.returns = [torch.full((r,), 0.5) for r in batch.response_lengths]
    history = [backend.train_step(batch) for _ in range(6)]
    backend.save_checkpoint(ckpt, {"step": 0})
    after = backend.compute_values(local)
    fresh = FSDPBackend.create(path, s)
    fresh.load_checkpoint(ckpt)
    return {"v0": v0, "after": after, "reloaded": fresh.compute_values(local), "history": history,
            "old": old, "rollout": batch.rollout_logprobs, "masks": batch.loss_masks}


def all_workers(rank: int, world: int, path: str, ckpt: str, cfg_path: str) -> dict:
    """Every worker of this file in one rank process, one after another."""
    return {"critic": critic_worker(rank, world, path, ckpt),
            "gspo": gspo_worker(rank, world, path) if world == 1 else None,
            "rank_batch": rank_batch_worker(rank, world, cfg_path)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    """{world size: each rank's results}. Each rank process pays its own start: the three tests'
    workers share one 1-rank and one 2-rank run, 3 processes where there were 7 (docs/testing.md,
    "Suite time")."""
    from milepost.config import load_config

    tmp = tmp_path_factory.mktemp("critic")
    path = make_tiny_checkpoint(tmp / "m", "qwen3", with_tokenizer=False)
    prompts = tmp / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = load_config(None, ["--hf-checkpoint", str(path), "--prompt-data", str(prompts), "--num-rollout", "1",
                             "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--device", "cpu",
                             "--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--kl-coef", "0.5",
                             "--kl-loss-type", "k1", "--gamma", "0.9", "--lambd", "0.8",
                             "--run-dir", str(tmp / "run")])
    cfg_path = str(cfg.write_resolved())
    return {world: run_ranks(all_workers, world, str(path), str(tmp / f"ckpt{world}"), cfg_path)
            for world in (1, 2)}


# One group: the fixture's ranks run once, on the worker that runs these tests.
shared_ranks = pytest.mark.xdist_group("train_critic_ranks")


@shared_ranks
def test_critic_learns_its_targets_and_survives_a_checkpoint(ranks: dict[int, list[dict]]) -> None:
    for world in (1, 2):
        results = [res["critic"] for res in ranks[world]]
        r = results[0]
        assert all(float(v.abs().max()) == 0.0 for v in r["v0"])  # zero-initialized head
        losses = [m["value_loss"] for m in r["history"]]
        assert math.isclose(losses[0], 0.125, rel_tol=1e-5)  # 0.5 * (0 - 0.5)^2 on every loss token
        assert losses[-1] < 0.5 * losses[0], losses
        for a, b in zip(r["after"], r["reloaded"]):
            torch.testing.assert_close(a, b)  # the critic (and its optimizer) came back from the checkpoint
        # TIS metrics of the first step: hand values over all ranks' loss tokens
        ratios, masks = [], []
        for res in results:
            for o, ro, m in zip(res["old"], res["rollout"], res["masks"]):
                ratios.append(torch.exp(o.double() - ro.double()))
                masks.append(m > 0)
        ratio = torch.cat(ratios)[torch.cat(masks)]
        first = r["history"][0]
        assert math.isclose(first["rollout_ratio"], float(ratio.mean()), rel_tol=1e-5)
        assert math.isclose(first["rollout_ratio_clipfrac"], float(((ratio > 1.5) | (ratio < 0.05)).double().mean()), rel_tol=1e-6)
        assert math.isclose(first["rollout_ratio_abs_dev"], float((ratio - 1).abs().mean()), rel_tol=1e-5)
        assert 0 < first["rollout_ratio_clipfrac"] < 1  # the random rollout log-probs are often far off


def gspo_worker(rank: int, world: int, path: str) -> dict:
    s = TrainerSettings(lr=1e-3, global_batch_size=2, ratio_level="sequence", loss_aggregation="sequence_mean",
                        eps_clip=3e-4, eps_clip_high=4e-4)
    backend = FSDPBackend.create(path, s)
    return backend.train_step(random_train_batch(4, seed=5))  # 2 optimizer steps: the second one clips


@shared_ranks
def test_gspo_trains_and_clips_whole_sequences(ranks: dict[int, list[dict]]) -> None:
    m = ranks[1][0]["gspo"]
    assert m["optimizer_steps"] == 2.0 and math.isfinite(m["loss"])
    masks = random_train_batch(4, seed=5).loss_masks
    second_step_share = float(masks[2].sum() + masks[3].sum()) / float(sum(x.sum() for x in masks))
    # only second-step sequences can have moved out of [1 - 3e-4, 1 + 4e-4], and they clip whole
    assert 0.0 < m["pg_clipfrac"] <= second_step_share + 1e-9


def rank_batch_worker(rank: int, world: int, cfg_path: str) -> dict:
    from milepost.config import load_config
    from milepost.driver.objective import rank_batch
    from milepost.driver.trainer_settings import trainer_settings

    cfg = load_config(cfg_path)
    backend = FSDPBackend.create(cfg.hf_checkpoint, trainer_settings(cfg))
    samples = probe_samples() * 2
    for i, s in enumerate(samples):
        s.group_index, s.reward = i // 2, float(i % 3 == 0)
    batch = rank_batch(cfg, backend, samples, rank, world)
    mine = split_for_rank(samples, rank, world, cfg.global_batch_size)
    return {"mine": mine, "adv": batch.advantages, "returns": batch.returns, "ref": batch.ref_logprobs}


@shared_ranks
def test_rank_batch_ppo_with_kl_reward_is_the_same_on_one_and_two_ranks(ranks: dict[int, list[dict]]) -> None:
    """Values and KL penalties are scored per rank and gathered: the advantages must not depend on
    how the rollout was split."""
    by_world = {}
    for world in (1, 2):
        adv: dict[int, torch.Tensor] = {}
        for res in (r["rank_batch"] for r in ranks[world]):
            assert res["returns"] is not None and res["ref"] is not None
            adv.update(zip(res["mine"], res["adv"]))
        by_world[world] = [adv[i] for i in range(8)]
    for a, b in zip(by_world[1], by_world[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    flat = torch.cat(by_world[1])
    assert abs(float(flat.mean())) < 1e-4  # whitened over the rollout's loss tokens
