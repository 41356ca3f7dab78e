"""Native models against transformers on tiny random checkpoints: logits, routing, weight names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention, VarlenCausalAttention
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.registry import build_model, load_model
from milepost.testing.checkpoints import make_tiny_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so scaling changes the frequencies we test at
}
VARIANTS = {
    "llama": ("llama", {}),
    "llama_biased_llama3": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
    ),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),  # layer 1 dense
}
ATOL = 1e-4
LENS = [5, 12, 9]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        name: make_tiny_checkpoint(root / name, arch, seed=i, with_tokenizer=False, **kw)
        for i, (name, (arch, kw)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def pairs(checkpoints: dict[str, Path]) -> dict[str, tuple[CausalLM, torch.nn.Module]]:
    out = {}
    for name, path in checkpoints.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        out[name] = (load_model(path, torch.float32, "cpu"), hf.eval())
    return out


def sequences(vocab: int, lens: list[int] = LENS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lens]


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [hf(s[None]).logits[0].float() for s in seqs]


def varlen_forward(model: CausalLM, seqs: list[torch.Tensor], **ctx_kw) -> torch.Tensor:
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    ctx = ForwardContext(VarlenCausalAttention(cu), **ctx_kw)
    return model.compute_logits(model(torch.cat(seqs), positions, ctx))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_varlen_prefill_matches_transformers(pairs, name: str) -> None:
    model, hf = pairs[name]
    seqs = sequences(model.vocab_size)
    with torch.no_grad():
        got = varlen_forward(model, seqs)
    torch.testing.assert_close(got, torch.cat(hf_logits(hf, seqs)), atol=ATOL, rtol=0)


def paged_run(model: CausalLM, seqs: list[torch.Tensor], steps: list[list[int]], block_size: int = 4):
    """Run a schedule (steps[s][i] = new tokens of sequence i) over a paged cache with shuffled,
    non-contiguous blocks; returns per-sequence logits [L, vocab] assembled across steps."""
    need = [-(-len(s) // block_size) for s in seqs]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)).tolist()
    tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(seqs))]
    cache = PagedKVCache(model.num_layers, sum(need), block_size, model.num_kv_heads, model.head_dim,
                         torch.float32, "cpu")  # fmt: skip
    att = TorchPagedAttention(cache)
    done, outs = [0] * len(seqs), [[] for _ in seqs]
    for step in steps:
        members = [i for i, n in enumerate(step) if n]
        batch = PagedBatch.build(
            query_lens=[step[i] for i in members],
            seq_lens=[done[i] + step[i] for i in members],
            block_tables=[tables[i] for i in members],
            block_size=block_size,
        )
        att.prepare(batch)
        ids = torch.cat([seqs[i][done[i] : done[i] + step[i]] for i in members])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, batch.positions, ForwardContext(att)))
        start = 0
        for i in members:
            outs[i].append(logits[start : start + step[i]])
            start += step[i]
            done[i] += step[i]
    assert done == [len(s) for s in seqs]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_paged_prefill_matches_transformers(pairs, name: str) -> None:
    model, hf = pairs[name]
    seqs = sequences(model.vocab_size)
    for got, ref in zip(paged_run(model, seqs, [LENS]), hf_logits(hf, seqs)):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_paged_chunked_prefill_and_mixed_decode_match_transformers(pairs, name: str) -> None:
    model, hf = pairs[name]
    seqs = sequences(model.vocab_size, [14, 9, 11], seed=1)
    steps = [
        [6, 7, 0],  # seq 0: first prompt chunk; seq 1: whole prompt
        [4, 1, 5],  # seq 0: second chunk, seq 1 decodes, seq 2 first chunk (mixed batch)
        [1, 1, 6],  # decodes beside the rest of seq 2's prompt
        [1, 0, 0],
    ] + [[1, 0, 0]] * 2  # pure decode at the end (all q_len == 1)
    for got, ref in zip(paged_run(model, seqs, steps), hf_logits(hf, seqs)):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


# --- MoE routing ------------------------------------------------------------------------------------


def hf_router_ids(hf: torch.nn.Module, seqs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Expert ids transformers' router picks, per MoE layer: [T, top_k] over the packed sequences."""
    picked: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            hook = lambda mod, args, out, i=i: picked.setdefault(i, []).append(out[2].clone())  # noqa: E731
            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    hf_logits(hf, seqs)
    for h in hooks:
        h.remove()
    return {i: torch.cat(v) for i, v in picked.items()}


def test_routed_experts_match_transformers_router(pairs) -> None:
    model, hf = pairs["qwen3_moe"]
    seqs = sequences(model.vocab_size)
    routed = torch.full((sum(LENS), model.num_layers, model.moe_top_k), -1, dtype=torch.int32)
    with torch.no_grad():
        varlen_forward(model, seqs, routed_experts=routed)
    ref = hf_router_ids(hf, seqs)
    assert sorted(ref) == [0, 2]
    for layer, ids in ref.items():
        assert torch.equal(routed[:, layer, :].long(), ids.long()), f"layer {layer}"
    assert (routed[:, 1, :] == -1).all(), "the dense layer must leave its slice untouched"


def test_forced_experts_replay_and_router_gradients(pairs) -> None:
    model, _ = pairs["qwen3_moe"]
    seqs = sequences(model.vocab_size)
    routed = torch.full((sum(LENS), model.num_layers, model.moe_top_k), -1, dtype=torch.int32)
    with torch.no_grad():
        natural = varlen_forward(model, seqs, routed_experts=routed)
        forced = routed.long().clamp(min=0)  # the dense layer's ids are ignored
        replayed = varlen_forward(model, seqs, forced_experts=forced)
        shifted = varlen_forward(model, seqs, forced_experts=(forced + 1) % model.num_experts)
    torch.testing.assert_close(replayed, natural, atol=1e-6, rtol=0)
    assert (shifted - natural).abs().max() > 1e-3, "forcing other experts must change the logits"

    model.zero_grad()
    logits = varlen_forward(model, seqs, forced_experts=(forced + 1) % model.num_experts)
    logits.logsumexp(-1).sum().backward()
    gate_grad = model.model.layers[0].mlp.gate.weight.grad
    assert gate_grad is not None and gate_grad.abs().sum() > 0, "router must get gradients under replay"
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_backward_reaches_every_weight(pairs, name: str) -> None:
    model, _ = pairs[name]
    varlen_forward(model, sequences(model.vocab_size)).log_softmax(-1)[:, 3].sum().backward()
    params = dict(model.named_parameters())
    try:
        missing = [n for n, p in params.items() if p.grad is None or not torch.isfinite(p.grad).all()]
        assert not missing
    finally:
        model.zero_grad(set_to_none=True)


# --- weights by Hugging Face name -------------------------------------------------------------------


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_weight_view_round_trips_the_checkpoint(pairs, checkpoints, name: str) -> None:
    model, _ = pairs[name]
    ckpt = checkpoint_tensors(checkpoints[name])
    names = model.hf_weight_names()
    assert len(names) == len(set(names))
    expected = set(ckpt) - ({"lm_head.weight"} if model.tie_word_embeddings else set())
    assert set(names) == expected
    for n in names:
        assert torch.equal(model.weight_view(n), ckpt[n]), n
    if model.tie_word_embeddings:
        assert model.weight_view("lm_head.weight").data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    "name,bad",
    [
        ("llama", "model.layers.0.self_attn.q_norm.weight"),
        ("llama", "model.layers.9.mlp.up_proj.weight"),
        ("qwen3", "model.layers.0.self_attn.q_proj.weights"),
        ("qwen3_moe", "model.layers.1.mlp.experts.0.gate_proj.weight"),  # dense layer
        ("qwen3_moe", "model.layers.0.mlp.experts.8.up_proj.weight"),  # only 8 experts
        ("qwen3_moe", "model.layers.0.mlp.experts.w13"),  # internal name, not a hub name
    ],
)
def test_weight_view_unknown_name_raises_key_error(pairs, name: str, bad: str) -> None:
    with pytest.raises(KeyError, match=bad.replace(".", r"\.")):
        pairs[name][0].weight_view(bad)


def test_expert_names_map_to_stacked_slices(checkpoints, pairs) -> None:
    model = load_model(checkpoints["qwen3_moe"], torch.float32, "cpu")
    _, hf = pairs["qwen3_moe"]
    experts, inter = model.model.layers[2].mlp.experts, model.hf_config.moe_intermediate_size
    # transformers' fused in-memory tensors are gate rows then up rows: our fused views equal them.
    hf_experts = hf.model.layers[2].mlp.experts
    assert torch.equal(model.weight_view("model.layers.2.mlp.experts.gate_up_proj"), hf_experts.gate_up_proj)
    assert torch.equal(model.weight_view("model.layers.2.mlp.experts.down_proj"), hf_experts.down_proj)
    model.weight_view("model.layers.2.mlp.experts.3.up_proj.weight").fill_(7.0)
    model.weight_view("model.layers.2.mlp.experts.5.down_proj.weight").fill_(-1.0)
    assert (experts.w13[3, inter:] == 7).all() and not (experts.w13[3, :inter] == 7).any()
    assert not (experts.w13[2] == 7).any() and (experts.w2[5] == -1).all() and not (experts.w2[4] == -1).any()


def test_load_model_accepts_fused_expert_names(pairs, tmp_path: Path, checkpoints) -> None:
    model, hf = pairs["qwen3_moe"]
    shutil.copy(checkpoints["qwen3_moe"] / "config.json", tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    reloaded = load_model(tmp_path, torch.float32, "cpu")
    seqs = sequences(model.vocab_size)
    with torch.no_grad():
        assert torch.equal(varlen_forward(reloaded, seqs), varlen_forward(model, seqs))


def test_load_model_errors(tmp_path: Path, checkpoints) -> None:
    src = checkpoints["qwen3"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = checkpoint_tensors(src)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(tmp_path, torch.float32, "cpu")

    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unknown.*shared_expert"):
        load_model(tmp_path, torch.float32, "cpu")

    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3NextForCausalLM"]}))
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM.*model_type .qwen3. builds Qwen3ForCausalLM"):
        load_model(tmp_path, torch.float32, "cpu")


def test_build_model_dtype_ties_and_refusals(checkpoints) -> None:
    config = AutoConfig.from_pretrained(checkpoints["qwen3"])
    model = build_model(config, torch.bfloat16, "cpu")
    assert isinstance(model, CausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="layer_types.*linear_attention"):
        build_model(config, torch.float32, "cpu")


def test_tiny_checkpoint_special_ids_agree_with_its_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("milepost.testing.tokenizer")
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path, "qwen3", num_hidden_layers=1)
    config, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert tok.eos_token_id == config.eos_token_id and tok.pad_token_id == config.pad_token_id
    assert len(tok) <= config.vocab_size
