"""On CUDA: with --offload-actor-for-critic a PPO step's peak device memory holds the actor or the
critic, not both, and training is bitwise the same as with both resident (issue 9, report 3.2).

Run on the accelerator machine: `python -m pytest -q -s -m gpu tests/gpu/test_train_cuda_actor_critic.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GiB = 1 << 30
# ~120M parameters per model: its fp32 weights + AdamW moments (~1.4 GB) dwarf the activations
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)


def state_bytes(modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> int:
    tensors = [p for m in modules for p in m.parameters()]
    tensors += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    local = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.untyped_storage().nbytes() for t in local if t.is_cuda)


def ppo_step(backend: FSDPBackend, seed: int) -> dict[str, float]:
    # Short sequences: one attention tile, whose backward is deterministic, so runs compare bitwise.
    batch = random_train_batch(4, seed, vocab=30000, min_len=32, max_len=64)
    samples = [Sample(0, i, tokens=t.tolist(), response_length=r)
               for i, (t, r) in enumerate(zip(batch.tokens, batch.response_lengths))]
    batch.values = backend.compute_values(samples)
    batch.returns = [v + 0.5 * a for v, a in zip(batch.values, batch.advantages)]
    return backend.train_step(batch)


def worker(rank: int, world: int, path: str, turns: bool) -> dict:
    backend = FSDPBackend.create(path, TrainerSettings(
        lr=1e-4, critic_lr=1e-4, global_batch_size=4, max_tokens_per_micro_batch=512, device="cuda",
        dtype="bfloat16", actor_critic_turns=turns))
    metrics = [ppo_step(backend, 1)]  # the optimizer states exist from here on
    backend.residency.use("actor")
    actor = state_bytes([backend.policy], backend.optimizer)
    backend.residency.use("critic")
    critic = state_bytes([backend.critic.model], backend.critic.optimizer)
    backend.take_turn_stats()  # count the measured step's turns only
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    metrics.append(ppo_step(backend, 2))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    turn = backend.take_turn_stats()
    backend.residency.use("actor")
    params = [(p.to_local() if isinstance(p, DTensor) else p).detach().cpu() for p in backend.policy.parameters()]
    return {"peak": peak, "actor": actor, "critic": critic, "metrics": metrics, "params": params,
            "turn": None if turn is None else (turn.bytes, turn.seconds)}


def test_turns_lower_the_step_peak_and_change_no_number(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False, vocab_size=32768, **SHAPE)
    [both] = run_ranks(worker, 1, str(path), False, backend="nccl", timeout_s=300)
    [turns] = run_ranks(worker, 1, str(path), True, backend="nccl", timeout_s=300)
    print(f"actor state {both['actor'] / GiB:.2f} GiB, critic state {both['critic'] / GiB:.2f} GiB; step peak "
          f"{both['peak'] / GiB:.2f} GiB resident, {turns['peak'] / GiB:.2f} GiB taking turns; "
          f"turns moved {turns['turn'][0] / GiB:.2f} GiB in {turns['turn'][1]:.3f} s")
    assert turns["metrics"] == both["metrics"]
    assert all(torch.equal(a, b) for a, b in zip(both["params"], turns["params"]))
    assert both["turn"] is None and turns["turn"][0] > 0
    # the smaller model's whole state is off the device at the peak
    assert turns["peak"] <= both["peak"] - 0.9 * min(both["actor"], both["critic"]), (turns["peak"], both["peak"])
