"""FSDP2 backend on real gloo ranks: N ranks equal 1 rank, weights by HF name, export, learning."""

from __future__ import annotations


import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from milepost.models.registry import build_model, load_model
from milepost.testing.batches import random_train_batch as random_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.backend import TrainBackend
from milepost.train.batch import TrainBatch, split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample


def full_params(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in backend.policy.lm.named_parameters()
    }


SETTINGS = dict(
    lr=1e-3,  # Adam turns fp32 rounding of near-zero gradients into lr-sized steps: keep lr small
    lr_warmup_iters=1,
    global_batch_size=4,
    max_tokens_per_micro_batch=40,  # several micro-batches per step, uneven across ranks
    use_kl_loss=True,
    kl_loss_coef=0.1,
    kl_loss_type="k3",
    entropy_coef=0.01,
    eps_clip=0.01,  # tight, so the second optimizer step of the rollout clips some tokens
    eps_clip_high=0.02,
)


def train_worker(rank: int, world: int, path: str) -> dict:
    backend = FSDPBackend.create(path, TrainerSettings(**SETTINGS))
    assert isinstance(backend, TrainBackend)
    full = random_batch(8, 1)  # one rollout of 8 samples = 2 optimizer steps
    mine = full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))
    metrics = [backend.train_step(mine)]
    probe = [Sample(0, 0, tokens=list(range(3, 3 + k)), response_length=k - 2) for k in (5, 9, 13)]
    return {
        "metrics": metrics,
        "params": full_params(backend),
        "hf": {n: t.clone() for n, t in backend.named_hf_weights()},
        "logprobs": backend.compute_logprobs(probe[: rank + 1]),  # ranks may score different counts
        "ref_logprobs": backend.compute_logprobs(probe, reference=True),
    }


def one_rank_workers(rank: int, world: int, qwen3: str, llama: str) -> dict:
    return {"train": train_worker(rank, world, qwen3), "learn": learn_worker(rank, world, llama)}


def two_rank_workers(rank: int, world: int, qwen3: str, moe: str, out: str) -> dict:
    # the export worker last: it ends with train steps every rank refuses
    return {"train": train_worker(rank, world, qwen3), "export": export_worker(rank, world, moe, out)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The workers of this file in one 1-rank and one 2-rank run (3 rank processes where there
    were 6: each pays its own start; docs/testing.md)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    qwen3 = str(make_tiny_checkpoint(tmp / "qwen3", "qwen3", with_tokenizer=False))
    llama = str(make_tiny_checkpoint(tmp / "llama", "llama", with_tokenizer=False))
    moe = make_tiny_checkpoint(tmp / "moe", "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    [one] = run_ranks(one_rank_workers, 1, qwen3, llama)
    two = run_ranks(two_rank_workers, 2, qwen3, str(moe), str(tmp / "export"))
    return {"qwen3": qwen3, "moe": moe, "export": tmp / "export", "one": one, "two": two}


# One group: the fixture's ranks run once, on the worker that runs these tests.
shared_ranks = pytest.mark.xdist_group("train_fsdp_ranks")


@shared_ranks
def test_two_ranks_equal_one_rank(ranks: dict) -> None:
    path, one, two = ranks["qwen3"], ranks["one"]["train"], [r["train"] for r in ranks["two"]]
    for m1, m2 in zip(one["metrics"], two[0]["metrics"]):
        assert m1.keys() == m2.keys() and m1["optimizer_steps"] == 2 and m1["tokens"] == m2["tokens"]
        for k in m1:
            assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-6), k
        assert m1["kl"] > 0 and 0 < m1["pg_clipfrac"] < 1 and m1["train_rollout_logprob_abs_diff"] > 0
    assert two[0]["metrics"] == two[1]["metrics"]
    for name, p in one["params"].items():
        torch.testing.assert_close(two[0]["params"][name], p, rtol=0, atol=1e-5)
        assert torch.equal(two[0]["params"][name], two[1]["params"][name])
    initial = load_model(path, torch.float32, "cpu")
    moved = max((initial.weight_view(n) - t).abs().max().item() for n, t in one["hf"].items())
    assert moved > 1e-4  # training changed the weights
    torch.testing.assert_close(two[1]["logprobs"][0], one["logprobs"][0], rtol=0, atol=1e-5)
    assert [t.shape[0] for t in two[1]["logprobs"]] == [3, 7]
    # The reference model never trains: its log-probs are those of the initial checkpoint.
    torch.testing.assert_close(two[0]["ref_logprobs"][2], one["ref_logprobs"][2], rtol=0, atol=1e-6)


def export_worker(rank: int, world: int, path: str, out: str) -> dict:
    settings = TrainerSettings(lr=1e-3, global_batch_size=2, max_tokens_per_micro_batch=64)
    backend = FSDPBackend.create(path, settings)
    full = random_batch(2, 5)
    backend.train_step(full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 2)))
    hf = {n: t.clone() for n, t in backend.named_hf_weights()}
    backend.export_hf(out)
    probe = [Sample(0, 0, tokens=[1, 40, 41, 42, 43, 44, 45, 46], response_length=6)]
    refused = []
    uneven = random_batch(2 + 2 * rank, 6)  # 2 samples on rank 0, 4 on rank 1
    lopsided = random_batch(2, 7)
    if rank == 1:
        lopsided.rollout_logprobs = None  # would make rank 0 alone run collectives: must be refused
    for bad in (uneven, lopsided):
        try:
            backend.train_step(bad)
        except ValueError as e:
            refused.append(str(e))
    return {"params": full_params(backend), "hf": hf, "logprobs": backend.compute_logprobs(probe), "refused": refused}


@shared_ranks
def test_moe_named_hf_weights_round_trip_and_export(ranks: dict) -> None:
    path, out, results = ranks["moe"], ranks["export"], [r["export"] for r in ranks["two"]]
    hf, params = results[0]["hf"], results[0]["params"]
    for r in results:  # refused on every rank, before any collective could hang
        assert "got [2, 4] per rank" in r["refused"][0]
        assert "rollout_logprobs is set on ranks [0] only" in r["refused"][1]
    assert all(torch.equal(hf[n], results[1]["hf"][n]) for n in hf)  # every rank yields the same
    fresh = build_model(load_model(path, torch.float32, "cpu").hf_config, torch.float32, "cpu")
    assert sorted(hf) == sorted(fresh.hf_weight_names())
    with torch.no_grad():
        for name, t in hf.items():
            fresh.weight_view(name).copy_(t)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, params[name]), name

    source_files = [f.name for f in path.iterdir() if not f.name.startswith("model")]
    assert "tokenizer.json" in source_files
    assert sorted(f.name for f in out.iterdir()) == sorted(source_files + ["model.safetensors"])
    native = load_model(out, torch.float32, "cpu")  # what `milepost serve --model out` loads
    assert all(torch.equal(native.weight_view(n), hf[n]) for n in hf)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.tensor([1, 40, 41, 42, 43, 44, 45, 46])
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens[None]).logits[0].float(), -1)[1:-1].gather(1, tokens[2:, None])[:, 0]
    torch.testing.assert_close(logp, results[0]["logprobs"][0], rtol=0, atol=1e-5)


def learn_worker(rank: int, world: int, path: str) -> dict:
    settings = TrainerSettings(lr=3e-3, global_batch_size=2, max_tokens_per_micro_batch=64, clip_grad=1.0)
    backend = FSDPBackend.create(path, settings)
    prompt, target, other = [1, 20, 21, 22], 77, 78
    samples = [Sample(0, 0, tokens=prompt + [target], response_length=1), Sample(0, 1, tokens=prompt + [other], response_length=1)]
    batch = TrainBatch.from_samples(samples, [torch.tensor([1.0]), torch.tensor([-1.0])])
    history = [float(backend.compute_logprobs(samples[:1])[0][0])]
    for i in range(6):
        backend.train_step(batch)
        if i == 2:  # offload between steps, as a colocated run does while engines generate
            backend.offload()
            backend.offload()  # idempotent
            with pytest.raises(RuntimeError, match="onload"):
                backend.train_step(batch)
            backend.onload()
        history.append(float(backend.compute_logprobs(samples[:1])[0][0]))
    # bf16 compute over fp32 master weights: trains, and exports in the compute dtype.
    bf16 = FSDPBackend.create(path, TrainerSettings(lr=3e-3, global_batch_size=2, dtype="bfloat16"))
    before = float(bf16.compute_logprobs(samples[:1])[0][0])
    for _ in range(3):
        bf16.train_step(batch)
    after = float(bf16.compute_logprobs(samples[:1])[0][0])
    dtypes = {t.dtype for _, t in bf16.named_hf_weights()}
    masters = {p.dtype for p in bf16.policy.parameters()}
    return {"history": history, "bf16": (before, after, dtypes, masters)}


@shared_ranks
def test_training_makes_rewarded_token_more_likely(ranks: dict) -> None:
    result = ranks["one"]["learn"]
    h = result["history"]
    assert all(b > a for a, b in zip(h, h[1:])), h
    assert h[-1] - h[0] > 0.5, h
    before, after, dtypes, masters = result["bf16"]
    assert after > before + 0.2 and dtypes == {torch.bfloat16} and masters == {torch.float32}
