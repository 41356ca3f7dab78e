"""Native Qwen2/2.5, Mistral, sliding-window Qwen3, Gemma 2/3, gpt-oss against transformers (packed, paged).

Every sliding window here is shorter than the test sequences, so a layer that ignored its
window (or applied it to the wrong layers) would change the log-probs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext
from milepost.models.llama import DecoderLM
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.hf_archs import make_tiny_hf_checkpoint
from milepost.testing.paged_run import paged_logits

torch.set_num_threads(1)
ATOL = 1e-4
LENS = [9, 14, 3]
# name -> (builder, arch, config overrides, windowed layers expected)
FAMILIES = {
    "qwen2": (make_tiny_hf_checkpoint, "qwen2", {}, [1, 2]),  # max_window_layers=1: layers 1-2 slide
    "qwen2_full": (make_tiny_hf_checkpoint, "qwen2_full", {}, []),
    "mistral": (make_tiny_hf_checkpoint, "mistral", {}, [0, 1, 2]),
    "mistral_no_window": (make_tiny_hf_checkpoint, "mistral", dict(sliding_window=None), []),
    "qwen3_sliding": (make_tiny_checkpoint, "qwen3",
                      dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1),
                      [1, 2]),
    "qwen3_moe_sliding": (make_tiny_checkpoint, "qwen3_moe",
                          dict(use_sliding_window=True, sliding_window=5), [0, 1]),
    "qwen3_yarn": (make_tiny_checkpoint, "qwen3", dict(rope_parameters={  # YaRN past a context of 8
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8}), []),
    "gemma2": (make_tiny_hf_checkpoint, "gemma2", {}, [0, 2]),  # every layer soft-capped too
    "gemma3": (make_tiny_hf_checkpoint, "gemma3", {}, [0, 2]),
    "gpt_oss": (make_tiny_hf_checkpoint, "gpt_oss", {}, [0, 2]),  # sinks everywhere, YaRN, MoE
    "gemma3_linear_rope": (make_tiny_hf_checkpoint, "gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}), [0, 2]),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    return {name: build(root / name, arch, seed=i, with_tokenizer=False, **kw)
            for i, (name, (build, arch, kw, _)) in enumerate(FAMILIES.items())}


def sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENS]


@pytest.fixture(scope="module")
def references(ckpts) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name, path in ckpts.items():
        ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        with torch.no_grad():
            out[name] = [ref(s[None]).logits[0].float() for s in sequences(ref.config.vocab_size)]
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_native_packed_and_paged_equal_transformers(ckpts, references, name: str) -> None:
    model = load_model(ckpts[name], torch.float32, "cpu")
    assert isinstance(model, DecoderLM), "this family must load natively"
    windowed = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.window is not None]
    assert windowed == FAMILIES[name][3]
    seqs, want = sequences(model.vocab_size), references[name]
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(n) for n in LENS])
    with torch.no_grad():
        packed = model.compute_logits(model(torch.cat(seqs), positions, ForwardContext(VarlenCausalAttention(cu))))
    torch.testing.assert_close(packed, torch.cat(want), atol=ATOL, rtol=0)
    model.fuse_projections()  # the engine's layout: q/k/v (and their biases) in one GEMM
    for got, ref in zip(paged_logits(model, seqs, first_chunks=[6, 2, 3]), want):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_qwen2_weights_are_hf_names_with_qkv_bias(ckpts) -> None:
    model = load_model(ckpts["qwen2_full"], torch.float32, "cpu")
    names = set(model.hf_weight_names())
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    model.fuse_projections()
    bias = model.weight_view("model.layers.0.self_attn.k_proj.bias")
    fused = model.model.layers[0].self_attn.qkv_proj.bias
    assert bias.data_ptr() == fused[model.model.layers[0].self_attn._qkv_sizes[0]:].data_ptr()


def test_gpt_oss_routing_equals_transformers_and_replays(ckpts) -> None:
    model = load_model(ckpts["gpt_oss"], torch.float32, "cpu")
    ref = AutoModelForCausalLM.from_pretrained(ckpts["gpt_oss"], attn_implementation="eager").eval()
    seqs = sequences(model.vocab_size)
    chosen: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: chosen.setdefault(i, []).append(out[2]))
             for i, layer in enumerate(ref.model.layers)]
    with torch.no_grad():
        for s in seqs:
            ref(s[None])
    for h in hooks:
        h.remove()
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(n) for n in LENS])
    routed = torch.full((sum(LENS), model.num_layers, model.moe_top_k), -1, dtype=torch.int32)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.cat(seqs), positions,
                                            ForwardContext(VarlenCausalAttention(cu), routed_experts=routed)))
        replay = ForwardContext(VarlenCausalAttention(cu), forced_experts=routed.long())
        replayed = model.compute_logits(model(torch.cat(seqs), positions, replay))
    for layer, ids in chosen.items():
        assert torch.equal(routed[:, layer].long().sort(-1).values, torch.cat(ids).sort(-1).values), layer
    torch.testing.assert_close(replayed, logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_engine_greedy_equals_generate(ckpts, name: str) -> None:
    """Through the engine itself (scheduler, chunked prefill, the windowed/capped/sink layers on
    VariantPagedAttention over fused projections): greedy tokens equal transformers `generate`."""
    from transformers import GenerationConfig

    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    args = ServerArgs(model_path=ckpts[name], device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=8, max_total_tokens=512).resolved()
    engine = build_engine(args)[0]
    assert isinstance(engine.runner.model, DecoderLM)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (10, 3, 6)]
    got: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True),
                              on_output=lambda o, i=i: got.setdefault(i, []).extend(o.new_token_ids)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    ref = AutoModelForCausalLM.from_pretrained(ckpts[name], attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None  # like ignore_eos (a None argument falls back to it)
    cfg = GenerationConfig(max_new_tokens=9, do_sample=False, pad_token_id=0, eos_token_id=None)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            assert got[i] == ref.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist(), i


@pytest.mark.parametrize("name", ["qwen2", "qwen2_full", "mistral", "gemma2", "gemma3", "gpt_oss"])
def test_weight_names_both_ways(ckpts, name: str) -> None:
    """Loading, the engine's fused layout and export all address exactly the checkpoint's names."""
    from safetensors.torch import load_file

    on_disk = load_file(ckpts[name] / "model.safetensors")
    model = load_model(ckpts[name], torch.float32, "cpu")
    assert set(model.hf_weight_names()) == set(on_disk)
    model.fuse_projections()  # q/k/v and gate/up rows now live in fused weights
    for hf_name, tensor in on_disk.items():
        assert torch.equal(model.weight_view(hf_name), tensor), hf_name
    exported = {n: t for p, full in model.named_parameters() for n, t in model.hf_tensors(p, full.detach())}
    assert exported.keys() == on_disk.keys()
    assert all(torch.equal(exported[n], t) for n, t in on_disk.items())
