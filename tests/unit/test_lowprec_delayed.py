"""Delayed FP8 scaling (`--fp8-scaling delayed`): the amax history's semantics, what it quantizes
(activations and output gradients, per tensor; the weights stay the shared quantizer's), exact
resume, and one scale across 2 real gloo ranks of the FSDP trainer."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from milepost.lowprec.contract import Contract
from milepost.lowprec.delayed import (
    DelayedScaling,
    DelayedSettings,
    attach_delayed,
    qdq_per_tensor,
)
from milepost.lowprec.linear import apply_train_precision, qdq
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.testing.lowprec_mlp import DecoderNamedMlp
from milepost.train.batch import split_for_rank
from milepost.train.checkpoint import checkpoint_path
from milepost.train.fsdp import FSDPBackend, TrainerSettings

torch.set_num_threads(1)


def _delayed(m: nn.Module, **kw: object) -> DelayedScaling:
    apply_train_precision(m, Contract("fp8_block", "fp8_block"))
    return attach_delayed(m, DelayedSettings(**kw), torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_window_algo_and_margin(algo: str) -> None:
    s = DelayedScaling(["w"], DelayedSettings(history_len=3, algo=algo, margin=1), torch.device("cpu"))
    x = torch.tensor([[0.5, -3.0]])
    # No history yet: an input quantizes as current scaling (1 x 128 blocks, as an engine without
    # a static scale); an output gradient by its own amax, with the margin (3 * 2 / 448).
    assert torch.equal(s.qdq(x * 7, 0, record=False), qdq(x * 7, "fp8_block"))
    assert torch.equal(s.qdq(x, 1, record=False), qdq_per_tensor(x, torch.tensor(6.0) / 448.0))
    for amax in (8.0, 2.0, 1.0, 0.5):  # the 8 leaves a window of 3 after the fourth step
        s.qdq(torch.tensor([[amax, 0.0]]), 0, record=True)
        s.qdq(torch.tensor([[amax / 2, 0.0]]), 0, record=True)  # a second micro-batch: max-ed in
        s.step()
    want = torch.tensor({"max": 2.0, "most_recent": 0.5}[algo] * 2) / 448.0  # float32 division
    assert s.scale[0] == want
    assert s.history[:, 0].tolist() == [0.5, 1.0, 2.0]
    s.step()  # a step that saw nothing: amax 0 enters the history
    assert s.scale[1] == 1.0  # the gradient slot never saw a positive amax: scale unchanged
    if algo == "most_recent":
        assert s.scale[0] == want  # amax 0 keeps the previous scale, as TE does
    y = s.qdq(torch.tensor([[1e3, 1.0, float("nan")]]), 0, record=False)
    assert torch.isnan(y).all()  # NaN in the tensor: NaN out, never a wrong finite value


def test_delayed_quantizes_activations_and_gradients_per_tensor_weights_unchanged() -> None:
    torch.manual_seed(0)
    ref, m = DecoderNamedMlp(), DecoderNamedMlp()
    m.load_state_dict(ref.state_dict())
    apply_train_precision(ref, Contract("fp8_block", "fp8_block"))
    state = _delayed(m)
    up, ref_up = m.model.layers[0].mlp.up_proj, ref.model.layers[0].mlp.up_proj
    # The weights are the shared quantizer's 128 x 128 tiles, as the engines hold them.
    assert torch.equal(up.quantized_weight(), ref_up.quantized_weight())
    for _ in range(2):  # a step to fill the history
        x = torch.randn(32, 64) * 3
        m(x).square().mean().backward()
        state.step()
    x = torch.randn(16, 64, requires_grad=True)
    y = up(x)
    wq = up.quantized_weight()
    sx = state.scale[state.slot("model.layers.0.mlp.up_proj.weight", "x")]
    xq = qdq_per_tensor(x.detach(), sx)
    assert torch.equal(y, xq @ wq.t())
    assert not torch.equal(xq, qdq(x.detach(), "fp8_block"))  # not the engines' 1 x 128 blocks
    up.weight.grad = None
    gy = torch.randn_like(y) * 1e-3
    y.backward(gy)
    gyq = qdq_per_tensor(gy, state.scale[state.slot("model.layers.0.mlp.up_proj.weight", "gy")])
    assert torch.allclose(x.grad, gyq @ wq, rtol=1e-6, atol=1e-9)
    assert torch.allclose(up.weight.grad, gyq.t() @ xq, rtol=1e-6, atol=1e-9)
    with torch.no_grad():  # a scoring pass reads the scales and records nothing
        before = state.pending.clone()
        up(torch.randn(4, 64) * 100)
    assert torch.equal(state.pending, before)


def _train(m: nn.Module, opt: torch.optim.Optimizer, state: DelayedScaling, seed: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen)
        loss = (m(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step()


def test_state_dict_resumes_exactly_and_refuses_another_length() -> None:
    torch.manual_seed(1)
    a = DecoderNamedMlp()
    sa = _delayed(a, history_len=4)
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    _train(a, opt_a, sa, 0, 3)
    buf = io.BytesIO()
    torch.save({"m": a.state_dict(), "o": opt_a.state_dict(), "s": sa.state_dict()}, buf)
    _train(a, opt_a, sa, 1, 3)

    b = DecoderNamedMlp()
    sb = _delayed(b, history_len=4)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    b.load_state_dict(saved["m"])
    opt_b.load_state_dict(saved["o"])
    sb.load_state_dict(saved["s"])
    _train(b, opt_b, sb, 1, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(sa.history, sb.history) and torch.equal(sa.scale, sb.scale)
    with pytest.raises(ValueError, match="--fp8-amax-history-len 4"):
        _delayed(DecoderNamedMlp(), history_len=8).load_state_dict(saved["s"])


SETTINGS = TrainerSettings(lr=1e-3, global_batch_size=4, max_tokens_per_micro_batch=40,
                           precision="fp8_block", fp8_scaling="delayed", fp8_amax_history_len=4)


def _params(b: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in b.policy.named_parameters()}


def _worker(rank: int, world: int, model: str, run: str) -> dict:
    def batch(seed: int):  # each rank its own samples: different amaxes before the reduction
        full = random_train_batch(8, seed)
        return full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))

    a = FSDPBackend.create(model, SETTINGS)
    a.train_step(batch(1))  # two optimizer steps
    a.save_checkpoint(checkpoint_path(run, 1))
    a.train_step(batch(2))
    b = FSDPBackend.create(model, SETTINGS)
    b.load_checkpoint(checkpoint_path(run, 1))
    b.train_step(batch(2))
    pa, pb = _params(a), _params(b)
    return {"scale": a.fp8_scaling.scale.clone(), "history": a.fp8_scaling.history.clone(),
            "updates": a.fp8_scaling.updates,
            "bitwise": all(torch.equal(pa[n], pb[n]) for n in pa),
            "same_state": torch.equal(a.fp8_scaling.history, b.fp8_scaling.history)}


def test_two_ranks_share_one_scale_and_resume_bitwise(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False)
    r0, r1 = run_ranks(_worker, 2, str(model), str(tmp_path / "run"))
    assert r0["updates"] == 4  # one history entry per optimizer step
    assert torch.equal(r0["scale"], r1["scale"]) and torch.equal(r0["history"], r1["history"])
    assert (r0["history"] > 0).all()  # every x and gy slot of every linear recorded, 4 steps
    assert r0["bitwise"] and r1["bitwise"] and r0["same_state"]


def test_settings_refuse_delayed_without_the_fp8_trainer() -> None:
    with pytest.raises(ValueError, match="fp8_scaling='delayed' needs precision='fp8_block'"):
        dataclasses.replace(SETTINGS, precision="mxfp8")


def test_compiled_layers_record_the_same_history() -> None:
    """--compile-layers: the delayed linear runs eagerly inside the compiled layer (it updates
    the history in place), with the eager model's history, scales and gradients. Dynamo's
    tracing and graph breaks decide that, not code generation: `aot_eager` proves it in well
    under a second where inductor compiled C++ for ~13 s on a cold cache (as in CI), as
    test_train_fast_path's compile test does; inductor's numerics are the optin trainer test's."""
    torch.manual_seed(2)
    a, b = DecoderNamedMlp(), DecoderNamedMlp()
    b.load_state_dict(a.state_dict())
    sa, sb = _delayed(a), _delayed(b)
    compiled = torch.compile(b, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(8, 64)
        for m, s in ((a, sa), (compiled, sb)):
            m(x).square().mean().backward()
            s.step()
    assert torch.equal(sa.history, sb.history) and torch.equal(sa.scale, sb.scale)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
