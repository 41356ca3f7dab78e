"""The trainer's fast path equals its reference path exactly on CPU fp32 (issue 15).

In-forward old log-probs vs the separate scoring pass, per-layer activation checkpointing vs
none, and the packed attention's gradients vs one autograd graph per sequence; plus the refusals
(a sample longer than the model's context).
"""

from __future__ import annotations


import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.models.attention import VarlenCausalAttention
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.fsdp import FSDPBackend, TrainerSettings

BASE = {"lr": 1e-3, "global_batch_size": 6, "max_tokens_per_micro_batch": 48, "entropy_coef": 0.01,
        "eps_clip": 0.2, "ratio_correction": "tis", "tis_clip_low": 0.05, "tis_clip": 1.5}


SUMMED_PER_MICRO_BATCH = ("train_rollout_logprob_abs_diff", "rollout_ratio", "rollout_ratio_clipfrac",
                          "rollout_ratio_abs_dev")


def _params(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in backend.policy.lm.named_parameters()}


def _train(rank: int, world: int, path: str, overrides: dict, rollouts: int) -> dict:
    torch.set_num_threads(1)
    backend = FSDPBackend.create(path, TrainerSettings(**{**BASE, **overrides}))
    metrics = [backend.train_step(random_train_batch(6, seed)) for seed in range(rollouts)]
    return {"metrics": metrics, "params": _params(backend)}


# Each rank process pays its own start (process group, gloo, forked from run_ranks' preloaded
# server); the variants compared below are trainers built one after another in one rank process,
# and the context refusal runs there too: one process where there were five (docs/testing.md).
VARIANTS = {"fast": {}, "separate": {"separate_old_logprob_pass": True},
            "layer_ckpt": {"activation_checkpointing": "layer"}}


def _train_variants(rank: int, world: int, path: str, short_path: str) -> dict:
    out: dict = {name: _train(rank, world, path, overrides, 2) for name, overrides in VARIANTS.items()}
    out["too_long"] = _too_long(rank, world, short_path)
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", "qwen3", with_tokenizer=False))


@pytest.fixture(scope="module")
def variants(qwen3: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two rollouts of each trainer variant, and the too-long refusal (a 32-position model)."""
    short = make_tiny_checkpoint(tmp_path_factory.mktemp("short") / "short", "qwen3",
                                 with_tokenizer=False, max_position_embeddings=32)
    [out] = run_ranks(_train_variants, 1, qwen3, str(short))
    return out


# One group: the fixture's rank process runs once, on the worker that runs these tests.
shared_rank = pytest.mark.xdist_group("train_fast_path_variants")


def _assert_same(a: dict, b: dict) -> None:
    for ma, mb in zip(a["metrics"], b["metrics"]):
        assert ma.keys() == mb.keys()
        for k in ma:
            if k in SUMMED_PER_MICRO_BATCH:  # the same terms, added in another order
                assert ma[k] == pytest.approx(mb[k], rel=1e-6), k
            else:
                assert ma[k] == mb[k], (k, ma[k], mb[k])
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), name


@shared_rank
def test_in_forward_old_logprobs_equal_the_separate_pass(variants: dict) -> None:
    # Two rollouts: the second starts from trained weights, so old != initial policy there too.
    fast, ref = variants["fast"], variants["separate"]
    _assert_same(fast, ref)
    m = fast["metrics"][1]
    assert m["ppo_kl"] == 0.0 and m["train_rollout_logprob_abs_diff"] > 0 and m["rollout_ratio_clipfrac"] > 0


@shared_rank
def test_layer_checkpointing_changes_no_number(variants: dict) -> None:
    _assert_same(variants["layer_ckpt"], variants["fast"])


def test_packed_attention_gradients_match_per_sequence_graphs() -> None:
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    q, k, v = (torch.randn(sum(lens), h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 6, 15])
    out = VarlenCausalAttention(cu).attend(0, q, k, v, 0.3)
    weight = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t.detach()[s:e].clone().requires_grad_() for t in (q, k, v))
        o = VarlenCausalAttention(torch.tensor([0, e - s])).attend(0, qs, ks, vs, 0.3)
        torch.testing.assert_close(o, out[s:e], rtol=0, atol=0)
        ref = torch.autograd.grad((o * weight[s:e]).sum(), (qs, ks, vs))
        for got, want in zip(grads, ref):
            torch.testing.assert_close(got[s:e], want, rtol=1e-6, atol=1e-7)


def _too_long(rank: int, world: int, path: str) -> str:
    backend = FSDPBackend.create(path, TrainerSettings(global_batch_size=1))
    batch = random_train_batch(1, 0, min_len=40, max_len=40)
    try:
        backend.train_step(batch)
    except ValueError as err:
        return str(err)
    return ""


@shared_rank
def test_sample_longer_than_the_context_is_refused(variants: dict) -> None:
    msg = variants["too_long"]
    assert "max_position_embeddings (32)" in msg and "40 tokens" in msg


def test_activation_checkpointing_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainerSettings(activation_checkpointing="selective")  # type: ignore[arg-type]


def _logp_and_grads(lm, lens: list[int]):
    from milepost.models.base import ForwardContext
    from milepost.train.logprobs import pack, token_logprobs

    g = torch.Generator().manual_seed(len(lens))
    b = pack([torch.randint(3, 512, (n,), generator=g) for n in lens], [n - 2 for n in lens], "cpu")
    hidden = lm(b.input_ids, b.positions, ForwardContext(VarlenCausalAttention(b.cu_seqlens)))
    logp, ent = token_logprobs(lm, hidden, b.rows, b.targets)
    (logp.sum() + 0.1 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad(set_to_none=True)
    return logp.detach(), grads


def test_compiled_layers_match_eager_and_compile_once(qwen3: str) -> None:
    from torch._dynamo.utils import counters

    from milepost.models.registry import load_model
    from milepost.train.compile import compile_decoder_layers

    torch._dynamo.reset()
    eager, compiled = (load_model(qwen3, torch.float32, "cpu").train().requires_grad_(True) for _ in range(2))
    names = [n for n, _ in compiled.named_parameters()]
    compile_decoder_layers(compiled.model.layers, backend="aot_eager")  # tracing, not codegen: fast
    assert [n for n, _ in compiled.named_parameters()] == names
    graphs = []
    for lens in ([7, 9, 12], [5, 20], [30, 3, 4]):  # micro-batches of different token counts
        (lp_c, g_c), (lp_e, g_e) = _logp_and_grads(compiled, lens), _logp_and_grads(eager, lens)
        torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=1e-5)
        for n in g_e:
            torch.testing.assert_close(g_c[n], g_e[n], rtol=1e-4, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[2] == graphs[1] == graphs[0]  # no recompile per shape or per layer


def test_compile_layers_refuses_layer_checkpointing() -> None:
    with pytest.raises(ValueError, match="compile_layers"):
        TrainerSettings(compile_layers=True, activation_checkpointing="layer")


@pytest.mark.optin  # inductor compiles C++ on CPU: minutes on a busy machine
def test_trainer_step_with_compiled_layers_matches_eager(qwen3: str) -> None:
    [compiled] = run_ranks(_train, 1, qwen3, {"compile_layers": True}, 1, timeout_s=900)
    [eager] = run_ranks(_train, 1, qwen3, {}, 1)
    for k in ("pg_loss", "entropy", "grad_norm", "rollout_ratio"):
        assert compiled["metrics"][0][k] == pytest.approx(eager["metrics"][0][k], rel=1e-4), k
    from milepost.models.registry import load_model

    initial = load_model(qwen3, torch.float32, "cpu")
    moved = torch.cat([(p - initial.get_parameter(n).detach()).abs().flatten() for n, p in eager["params"].items()])
    apart = torch.cat([(compiled["params"][n] - p).abs().flatten() for n, p in eager["params"].items()])
    # fused kernels round differently; Adam turns a near-zero gradient's sign into an lr-sized step
    assert apart.mean() < 0.01 * moved.mean(), (float(apart.mean()), float(moved.mean()))
