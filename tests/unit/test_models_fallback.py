"""The transformers fallback against transformers itself: packed log-probs, names, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.hf_fallback import HFCausalLM
from milepost.models.masked_attention import Variant, attend_one
from milepost.models.registry import load_model
from milepost.testing.hf_archs import make_tiny_hf_checkpoint
from milepost.testing.paged_run import paged_logits

torch.set_num_threads(1)
FALLBACK_ARCHS = ["qwen2", "mistral", "gemma2", "gemma3", "phi3", "gpt_neox", "olmo2", "cohere", "gpt_oss"]
LENS = [7, 13, 2]  # longer than every tiny sliding window (4-5 tokens)
ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback")
    return {a: make_tiny_hf_checkpoint(root / a, a, seed=i) for i, a in enumerate(FALLBACK_ARCHS)}


def sequences(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENS]


def packed_logits(model: CausalLM, seqs: list[torch.Tensor]) -> torch.Tensor:
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    hidden = model(torch.cat(seqs), positions, ForwardContext(VarlenCausalAttention(cu)))
    return model.compute_logits(hidden)


@pytest.mark.parametrize("arch", FALLBACK_ARCHS)
def test_packed_and_paged_logprobs_equal_transformers(ckpts, arch: str) -> None:
    """Three sequences packed in one row (the trainer) and run over the paged KV cache (the
    engine) give each sequence's own log-probs (transformers eager on that sequence alone)."""
    model = load_model(ckpts[arch], torch.float32, "cpu", backend="transformers")
    assert isinstance(model, HFCausalLM) and isinstance(model, CausalLM)
    ref = AutoModelForCausalLM.from_pretrained(ckpts[arch], attn_implementation="eager").eval()
    seqs = sequences(model.vocab_size)
    with torch.no_grad():
        want = torch.cat([torch.log_softmax(ref(s[None]).logits[0].float(), -1) for s in seqs])
        got = torch.log_softmax(packed_logits(model, seqs), -1)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # The engine's way: paged KV in blocks of 4, a prefill chunk then decode steps, batched.
    paged = torch.cat([torch.log_softmax(x, -1) for x in paged_logits(model, seqs, first_chunks=[4, 5, 1])])
    torch.testing.assert_close(paged, want, atol=ATOL, rtol=0)


def test_gradients_flow_through_the_fallback(ckpts) -> None:
    model = load_model(ckpts["gemma2"], torch.float32, "cpu", backend="transformers")
    model.train()
    assert not any(m.training for m in model.modules()), "dropout must stay off"
    loss = packed_logits(model, sequences(model.vocab_size)).logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None or g.abs().sum() == 0]


def test_window_softcap_and_sinks_follow_their_definition() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 8, generator=g) for h in (4, 2, 2))
    pos = torch.arange(6)
    sinks = torch.randn(4, generator=g)
    got = attend_one(q, k, v, pos, 0.3, Variant(window=3, softcap=2.0, sinks=sinks))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(6):
        for h in range(4):
            s = torch.tanh((kk[: i + 1, h] @ q[i, h]) * 0.3 / 2.0) * 2.0
            s[: max(0, i - 2)] = float("-inf")  # keys older than the 3-token window
            p = torch.softmax(torch.cat([s, sinks[h : h + 1]]), 0)[:-1]
            torch.testing.assert_close(got[i, h], p @ vv[: i + 1, h])
    plain = attend_one(q, k, v, pos, 0.3, Variant())
    assert not torch.allclose(plain, got)


def test_weight_names_aliases_and_updates(ckpts) -> None:
    model = load_model(ckpts["qwen2"], torch.float32, "cpu", backend="transformers")
    names = model.hf_weight_names()
    on_disk = json.loads((ckpts["qwen2"] / "model.safetensors.index.json").read_text())["weight_map"] \
        if (ckpts["qwen2"] / "model.safetensors.index.json").exists() else None
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert on_disk is None or set(on_disk) == set(names)
    for name in names:
        view = model.weight_view(name)
        [(got_name, got)] = model.hf_tensors(name, view)
        assert got_name == name and got is view
    seqs = sequences(model.vocab_size)
    before = packed_logits(model, seqs)
    with torch.no_grad():
        model.weight_view("model.layers.1.mlp.down_proj.weight").zero_()
    assert not torch.allclose(before, packed_logits(model, seqs))
    with pytest.raises(KeyError, match="closest names.*q_proj.weight"):
        model.weight_view("model.layers.0.self_attn.q_proj.wieght")


def test_tied_head_answers_to_both_names(tmp_path: Path) -> None:
    path = make_tiny_hf_checkpoint(tmp_path / "t", "gpt_neox", tie_word_embeddings=True)
    model = load_model(path, torch.float32, "cpu")
    assert model.tie_word_embeddings
    emb = model.weight_view("gpt_neox.embed_in.weight")
    assert model.weight_view("lm_head.weight").data_ptr() == emb.data_ptr()
    assert "lm_head.weight" not in model.hf_weight_names()  # listed once, like native models


def test_backend_switch_and_refusals(ckpts, tmp_path: Path) -> None:
    native_dir = make_tiny_hf_checkpoint(tmp_path / "q2", "qwen2_full")
    assert getattr(load_model(native_dir, torch.float32, "cpu"), "native", True)
    assert isinstance(load_model(native_dir, torch.float32, "cpu", backend="transformers"), HFCausalLM)
    with pytest.raises(ValueError, match="no native path.*Phi3ForCausalLM"):
        load_model(ckpts["phi3"], torch.float32, "cpu", backend="native")

    remote = tmp_path / "remote"
    shutil.copytree(ckpts["olmo2"], remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="auto_map.*--trust-remote-code"):
        load_model(remote, torch.float32, "cpu")
    from milepost.engine.server_args import ServerArgs  # milepost serve refuses it at start

    with pytest.raises(ValueError, match="auto_map.*pass --trust-remote-code"):
        ServerArgs(model_path=remote)
    assert ServerArgs(model_path=remote, trust_remote_code=True).trust_remote_code

    hybrid = tmp_path / "hybrid"
    shutil.copytree(ckpts["qwen2"], hybrid)
    config = json.loads((hybrid / "config.json").read_text())
    config["layer_types"] = ["full_attention", "linear_attention", "full_attention"]
    (hybrid / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer_types.*linear_attention"):
        load_model(hybrid, torch.float32, "cpu")


def test_mla_and_linear_attention_models_are_refused_naming_why(tmp_path: Path) -> None:
    """On the fallback, DeepSeek-V3's MLA (K and V of different head sizes) and Qwen3-Next's
    linear-attention layers have no place in the paged KV cache: refused at load, not run wrong."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=300,
                  max_position_embeddings=256, pad_token_id=0)
    mla = transformers.DeepseekV3Config(
        **common, num_hidden_layers=2, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1)
    hybrid = transformers.Qwen3NextConfig(
        **common, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    for config, cls, match in ((mla, "DeepseekV3ForCausalLM", r"K/V shapes.*\(4, 24, 4, 16\)"),
                               (hybrid, "Qwen3NextForCausalLM", "layer_types.*linear_attention")):
        config.architectures = [cls]
        getattr(transformers, cls)(config).save_pretrained(tmp_path / cls)
        with pytest.raises(ValueError, match=match):  # DeepSeek-V3 itself loads natively (MLA cache)
            load_model(tmp_path / cls, torch.float32, "cpu", backend="transformers")
