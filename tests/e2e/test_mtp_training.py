"""MTP co-training (`enable_mtp_training`): the MTP layer learns the rollouts beside the policy
loss, the policy's update stays exactly the one it gets without it, and the NEXTN draft's
acceptance length rises on the prompts the run trains on (real FSDP2 rank, real engines, tiny
DeepSeek-V3). An RL run revisits its prompt set; on prompts never trained on, this tiny random
model's MTP layer barely generalizes (benchmarks/RESULTS.md has both numbers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.sampling import SamplingParams
from milepost.models.registry import load_model
from milepost.testing.dist import run_ranks
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from tests.e2e.test_speculative_engine_live import Run
from tests.e2e.test_speculative_mtp import make_engine

MTP = "model.layers.3."
VOCAB = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mtp_checkpoint(tmp_path_factory.mktemp("mtp_train") / "m", seed=3, vocab_size=VOCAB)


def rollouts(path: Path, n: int, seed: int, spec: bool = False) -> tuple[list[list[int]], list[int], float]:
    """Greedy continuations of n random prompts: (prompt + response tokens, prompt lengths, the
    NEXTN acceptance length when spec)."""
    g = torch.Generator().manual_seed(seed)
    flags = {"speculative_algorithm": "NEXTN"} if spec else {}
    r = Run(make_engine(path, max_running_requests=64, max_total_tokens=8192, **flags))
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    for i, p in enumerate(prompts):
        r.submit(f"r{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    r.run()
    seqs = [p + r.tokens(f"r{i}") for i, p in enumerate(prompts)]
    accept = r.engine.speculator.stats.accept_length if spec else 0.0
    return seqs, [len(p) for p in prompts], accept


def batch_of(seqs: list[list[int]], prompt_lens: list[int]) -> TrainBatch:
    """Zero advantages: the policy loss has no gradient, only the MTP layer learns."""
    tokens = [torch.tensor(s) for s in seqs]
    resp = [len(s) - p for s, p in zip(seqs, prompt_lens)]
    return TrainBatch(tokens, resp, [torch.ones(r) for r in resp], [torch.zeros(r) for r in resp],
                      rollout_logprobs=[torch.zeros(r) for r in resp])


def cotrain(rank: int, world: int, ckpt: str, seqs: list, prompt_lens: list, out: str, steps: int) -> dict:
    # Advantages of one sign on a held-out batch, so the policy does move in the comparison step.
    g = torch.Generator().manual_seed(1)
    moving = batch_of(seqs[:4], prompt_lens[:4])
    moving.advantages = [torch.randn(a.shape, generator=g) for a in moving.advantages]
    base = dict(lr=1e-2, global_batch_size=4, clip_grad=0.5)
    plain = FSDPBackend.create(ckpt, TrainerSettings(**base))
    co = FSDPBackend.create(ckpt, TrainerSettings(**base, enable_mtp_training=True,
                                                  mtp_loss_scaling_factor=1.0))
    plain_metrics, co_metrics = plain.train_step(moving), co.train_step(moving)
    a, b = dict(plain.named_hf_weights()), dict(co.named_hf_weights())
    loaded = load_model(ckpt, torch.float32, "cpu")
    result = {
        "policy_equal": all(torch.equal(a[n], b[n]) for n in a if not n.startswith(MTP)),
        "policy_moved": any(not torch.equal(a[n], loaded.weight_view(n)) for n in a if not n.startswith(MTP)),
        "mtp_moved": any(not torch.equal(a[n], b[n]) for n in a if n.startswith(MTP)),
        "grad_norms": [plain_metrics["grad_norm"], co_metrics["grad_norm"]],
        "has_mtp_loss": "mtp_loss" in co_metrics and "mtp_loss" not in plain_metrics,
    }
    # Then the MTP layer alone learns the greedy rollouts (zero advantages: the policy stays).
    learner = FSDPBackend.create(ckpt, TrainerSettings(lr=1e-2, global_batch_size=len(seqs),
                                                       enable_mtp_training=True, mtp_loss_scaling_factor=1.0))
    batch = batch_of(seqs, prompt_lens)
    result["mtp_loss"] = [learner.train_step(batch)["mtp_loss"] for _ in range(steps)]
    learner.export_hf(out)
    return result


def test_mtp_cotraining_raises_acceptance_and_leaves_the_policy_update_alone(ckpt, tmp_path) -> None:
    seqs, prompt_lens, _ = rollouts(ckpt, 32, seed=0)
    (r,) = run_ranks(cotrain, 1, str(ckpt), seqs, prompt_lens, str(tmp_path / "co"), 20, timeout_s=240)
    assert r["policy_moved"] and r["mtp_moved"] and r["has_mtp_loss"]
    assert r["policy_equal"], "the MTP loss must not change the policy's update (detached, clipped apart)"
    assert r["grad_norms"][0] == r["grad_norms"][1]
    losses = r["mtp_loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    seen = {}
    for name, path in (("before", ckpt), ("after", tmp_path / "co")):
        out, _, seen[name] = rollouts(path, 32, seed=0, spec=True)
        seen[name + "_tokens"] = out
    assert seen["after_tokens"] == seen["before_tokens"] == seqs, "the policy is unchanged"
    assert seen["after"] > seen["before"] + 0.3, seen
