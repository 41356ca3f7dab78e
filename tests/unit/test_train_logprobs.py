"""Packed, chunked token log-probs against transformers per sequence; hf_tensors inverts weight_view."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext
from milepost.models.registry import build_model, load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.train.logprobs import TokenScorer, pack, token_logprobs

ARCHS = {"qwen3": {}, "qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]), "llama": {}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {a: make_tiny_checkpoint(root / a, a, seed=3, with_tokenizer=False, **kw) for a, kw in ARCHS.items()}


def sequences(seed: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens, resp = [7, 19, 4, 12], [3, 11, 1, 11]
    return [torch.randint(3, 512, (n,), generator=g) for n in lens], resp


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_logprobs_match_transformers_per_sequence(checkpoints, arch: str) -> None:
    path = checkpoints[arch]
    scorer = TokenScorer(load_model(path, torch.float32, "cpu"), temperature=0.7, chunk_size=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    seqs, resp = sequences()
    with torch.no_grad():
        logp, entropy = scorer.score(pack(seqs, resp, "cpu"))
    got_lp, got_ent = logp.split(resp), entropy.split(resp)
    for seq, r, lp, ent in zip(seqs, resp, got_lp, got_ent):
        with torch.no_grad():
            logits = hf(seq[None]).logits[0].float() / 0.7
        all_lp = torch.log_softmax(logits[len(seq) - r - 1 : -1], dim=-1)
        want = all_lp.gather(1, seq[len(seq) - r :, None])[:, 0]
        torch.testing.assert_close(lp, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, -(all_lp.exp() * all_lp).sum(-1), rtol=0, atol=1e-5)


def test_chunked_equals_unchunked_values_and_gradients(checkpoints) -> None:
    lm = load_model(checkpoints["qwen3"], torch.float32, "cpu")
    seqs, resp = sequences(1)
    b = pack(seqs, resp, "cpu")
    ctx = ForwardContext(VarlenCausalAttention(b.cu_seqlens))
    results = []
    for chunk, ckpt in ((3, True), (10**6, False)):
        lm.zero_grad(set_to_none=True)
        hidden = lm(b.input_ids, b.positions, ctx)
        lp, ent = token_logprobs(lm, hidden, b.rows, b.targets, chunk_size=chunk, use_checkpoint=ckpt)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), lm.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    (lp_c, ent_c, g_c), (lp_u, ent_u, g_u) = results
    assert lp_c.shape == (sum(resp),)
    torch.testing.assert_close(lp_c, lp_u, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_c, ent_u, rtol=1e-6, atol=1e-6)  # entropies ~6: fp32 rounding
    torch.testing.assert_close(g_c, g_u, rtol=1e-4, atol=1e-5)


def test_pack_layout_and_refusals() -> None:
    b = pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [2, 1], "cpu")
    assert b.cu_seqlens.tolist() == [0, 3, 5] and b.positions.tolist() == [0, 1, 2, 0, 1]
    assert b.rows.tolist() == [0, 1, 3] and b.targets.tolist() == [6, 7, 9]
    with pytest.raises(ValueError, match="response_length"):
        pack([torch.tensor([5, 6])], [2], "cpu")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_hf_tensors_inverts_weight_view(checkpoints, arch: str) -> None:
    model = load_model(checkpoints[arch], torch.float32, "cpu")
    produced = {}
    for name, param in model.named_parameters():
        for hf_name, t in model.hf_tensors(name, param.detach().clone()):
            assert hf_name not in produced
            produced[hf_name] = t
    assert sorted(produced) == sorted(model.hf_weight_names())
    fresh = build_model(model.hf_config, torch.float32, "cpu")
    with torch.no_grad():
        for name, t in produced.items():
            fresh.weight_view(name).copy_(t)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n
