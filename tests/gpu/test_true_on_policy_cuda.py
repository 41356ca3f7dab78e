"""--true-on-policy on CUDA bf16: the engine's log-probs equal the FSDP trainer's (torch.equal).

Passed on one H200 on 2026-12-04 (3 passed, torch 2.11).
The engine samples with its CUDA kernels (Triton paged attention, CUDA graphs for decode) and
re-scores each finished sequence with the trainer's computation (FlashAttention varlen over one
sequence, torch RMSNorm / RoPE / SwiGLU, chunked log-softmax); the trainer (one NCCL rank,
fused kernels off under the flag) scores the same sequences one micro-batch each. Mixed batch,
chunked prefill and a prefix-cache hit, for a tiny qwen3, a tiny llama and the Qwen3-0.6B shape
(random weights). Run: `python -m pytest -q -m gpu tests/gpu/test_true_on_policy_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096}
PROMPT_A = list(range(5, 5 + 40))  # longer than a prefill chunk of 16
PROMPT_B = [7, 7, 21, 300, 5]


def cuda_worker(rank: int, world: int, path: str) -> dict:
    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine
    from milepost.train.batch import TrainBatch
    from milepost.train.fsdp import FSDPBackend, TrainerSettings
    from milepost.types import Sample

    args = ServerArgs(model_path=Path(path), device="cuda", dtype="bfloat16", page_size=16,
                      chunked_prefill_size=16, max_total_tokens=8192, mem_fraction_static=0.3,
                      true_on_policy=True).resolved()
    engine = build_engine(args)[0]
    outs: dict[int, list] = {}
    rounds = ([PROMPT_A, PROMPT_B, PROMPT_A[:9]], [PROMPT_A[:30] + [66, 67], PROMPT_B + [9, 9]])
    prompts = [p for r in rounds for p in r]
    k = 0
    for r in rounds:  # round 2 reuses round 1's cached prefix of PROMPT_A
        for p in r:
            params = SamplingParams(max_new_tokens=8 + 5 * k, temperature=1.0, sampling_seed=k, ignore_eos=True)
            engine.submit(Request(rid=f"r{k}", prompt_ids=p, params=params, stop_ids=frozenset(),
                                  return_logprob=True, on_output=lambda o, k=k: outs.setdefault(k, []).append(o)))
            k += 1
        engine._drain_inbox(block=False)
        while engine.scheduler.has_work:
            engine.step()
    torch.cuda.synchronize()
    seqs = [(prompts[i] + [t for o in outs[i] for t in o.new_token_ids],
             torch.tensor([x for o in outs[i] for x in o.new_logprobs], dtype=torch.float32)) for i in range(k)]
    cached = [outs[i][-1].cached_tokens for i in range(k)]
    engine.close()
    del engine
    torch.cuda.empty_cache()
    backend = FSDPBackend.create(path, TrainerSettings(global_batch_size=k, dtype="bfloat16", device="cuda",
                                                       true_on_policy=True, lr=1e-5))
    samples = [Sample(0, i, tokens=t, response_length=len(lp)) for i, (t, lp) in enumerate(seqs)]
    trainer = backend.compute_logprobs(samples)
    ones = [torch.ones(len(lp)) for _, lp in seqs]
    batch = TrainBatch([torch.tensor(t) for t, _ in seqs], [len(lp) for _, lp in seqs], ones, ones,
                       rollout_logprobs=[lp for _, lp in seqs])
    gap = backend.train_step(batch)["train_rollout_logprob_abs_diff"]
    return {"equal": [torch.equal(a.cpu(), b) for a, b in zip(trainer, (lp for _, lp in seqs))],
            "max_diff": max(float((a.cpu() - b).abs().max()) for a, b in zip(trainer, (lp for _, lp in seqs))),
            "gap": gap, "cached": cached}


@pytest.mark.parametrize("arch,shape", [("qwen3", {}), ("llama", {}), ("qwen3", QWEN3_06B)],
                         ids=["tiny-qwen3", "tiny-llama", "qwen3-0.6b-shape"])
def test_cuda_bf16_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path: Path, arch: str, shape: dict) -> None:
    path = make_tiny_checkpoint(tmp_path / arch, arch, with_tokenizer=False,
                                vocab_size=151936 if shape else 512, **shape)
    [r] = run_ranks(cuda_worker, 1, str(path), backend="nccl", timeout_s=600)
    assert r["cached"][3] > 0, r  # the prefix-cache hit happened
    assert all(r["equal"]), r
    assert r["gap"] == 0.0, r
