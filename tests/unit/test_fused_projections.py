"""The engine's fused q/k/v and gate/up GEMMs: same outputs, and every HF name still addresses
its rows (loading, weight updates from tensors and from disk, the trainer's inverse mapping)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from milepost.engine.weight_update import WeightLoader
from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention
from milepost.models.base import ForwardContext
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint

VARIANTS = {
    "llama_biased": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),  # layer 1 dense
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    return {name: make_tiny_checkpoint(root / name, arch, seed=i, with_tokenizer=False, **kw)
            for i, (name, (arch, kw)) in enumerate(VARIANTS.items())}


def fused_model(path: Path):
    model = load_model(path, torch.float32, "cpu")
    model.fuse_projections()
    return model


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Prefill then n-1 decode steps over a paged cache; the tokens and the first logits."""
    cache = PagedKVCache(model.num_layers, 16, 4, model.num_kv_heads, model.head_dim,
                         torch.float32, "cpu")
    att, ids, out, first = TorchPagedAttention(cache), list(prompt), [], None
    new = prompt
    with torch.no_grad():
        while len(out) < n:
            batch = PagedBatch.build([len(new)], [len(ids)], [list(range(16))], 4)
            att.prepare(batch)
            logits = model.compute_logits(model(torch.tensor(new), batch.positions,
                                                ForwardContext(att)))
            first = logits if first is None else first
            out.append(int(logits[-1].argmax()))
            ids.append(out[-1])
            new = out[-1:]
    return out, first


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_model_matches_unfused_and_transformers(checkpoints, name: str) -> None:
    path = checkpoints[name]
    plain, fused = load_model(path, torch.float32, "cpu"), fused_model(path)
    attn = fused.model.layers[0].self_attn
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    prompt = torch.randint(3, plain.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    want_tokens, want_logits = greedy(plain, prompt.tolist(), 8)
    got_tokens, got_logits = greedy(fused, prompt.tolist(), 8)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=8, do_sample=False)[0, 9:].tolist()
        torch.testing.assert_close(got_logits, hf(prompt[None]).logits[0], atol=1e-4, rtol=0)
    assert got_tokens == ref


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hf_names_address_rows_of_the_fused_weights(checkpoints, name: str) -> None:
    model = fused_model(checkpoints[name])
    ckpt = checkpoint_tensors(checkpoints[name])
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    q = model.weight_view("model.layers.0.self_attn.q_proj.weight")
    v = model.weight_view("model.layers.0.self_attn.v_proj.weight")
    assert q.data_ptr() == qkv.data_ptr() and v.data_ptr() + v.numel() * 4 == qkv.data_ptr() + qkv.numel() * 4
    for n in model.hf_weight_names():
        assert torch.equal(model.weight_view(n), ckpt[n]), n
    with pytest.raises(KeyError):
        model.weight_view("model.layers.0.self_attn.qkv_proj.weight")  # not a checkpoint name
    # The inverse (trainer side) covers every HF name once, with the same values.
    pairs = [pair for p, t in model.named_parameters() for pair in model.hf_tensors(p, t.detach())]
    assert sorted(n for n, _ in pairs) == sorted(model.hf_weight_names())
    assert all(torch.equal(t, ckpt[n]) for n, t in pairs)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_weight_updates_write_the_right_rows(checkpoints, name: str, tmp_path: Path) -> None:
    path = checkpoints[name]
    model = fused_model(path)
    loader = WeightLoader(model)
    g = torch.Generator().manual_seed(5)
    new = {n: torch.randn(t.shape, generator=g) for n, t in checkpoint_tensors(path).items()}
    names = [n for n in new if "layers.1." in n and ("proj" in n)]
    loader.from_named([(n, new[n]) for n in names])  # a partial update, as a bucket would be
    for n in model.hf_weight_names():
        want = new[n] if n in names else checkpoint_tensors(path)[n]
        assert torch.equal(model.weight_view(n), want), n
    # a full update from disk (require_complete checks coverage of the fused memory too)
    save_file(new, str(tmp_path / "model.safetensors"))
    assert loader.from_disk(str(tmp_path)) == len(new)
    reference = load_model(path, torch.float32, "cpu")
    WeightLoader(reference).from_disk(str(tmp_path))
    prompt = [5, 9, 17, 33, 2, 71]
    assert greedy(model, prompt, 4)[0] == greedy(reference, prompt, 4)[0]
    torch.testing.assert_close(greedy(model, prompt, 1)[1], greedy(reference, prompt, 1)[1],
                               atol=1e-5, rtol=0)
