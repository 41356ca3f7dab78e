"""HF <-> Megatron conversion: bit-exact round trips (also through TP/PP/EP shards), refusals, logits."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.train.megatron.convert import (
    hf_to_megatron,
    megatron_to_hf,
    shard,
    unshard,
)
from milepost.train.megatron.provider import read_hf_weights
from milepost.train.megatron.shape import shape_of

ARCHS = ("llama", "qwen3", "qwen3_moe")
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core not installed (pip install 'milepost[megatron]')")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("meg_ckpt")
    return {a: make_tiny_checkpoint(root / a, a, with_tokenizer=False) for a in ARCHS}


def _shape(path):
    return shape_of(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_exact(checkpoints, arch):
    path = checkpoints[arch]
    shape, hf = _shape(path), read_hf_weights(path)
    meg = hf_to_megatron(shape, hf)
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in meg
    back = megatron_to_hf(shape, meg)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("arch,tp,pp,ep", [("qwen3", 2, 1, 1), ("llama", 2, 2, 1), ("qwen3_moe", 2, 2, 2),
                                           ("qwen3_moe", 1, 1, 4)])
def test_shards_join_back_exactly(checkpoints, arch, tp, pp, ep):
    path = checkpoints[arch]
    shape = _shape(path)
    full = hf_to_megatron(shape, read_hf_weights(path))
    pieces = {(t, p, e): shard(shape, full, tp=tp, pp=pp, ep=ep, tp_rank=t, pp_rank=p, ep_rank=e)
              for t in range(tp) for p in range(pp) for e in range(ep)}
    one = pieces[(tp - 1, pp - 1, ep - 1)]
    qkv = one["decoder.layers.0.self_attention.linear_qkv.weight"]
    # per query group: (heads / groups + 2) x head_dim rows, groups split over TP
    assert qkv.shape[0] == shape.num_kv_heads // tp * (shape.num_heads // shape.num_kv_heads + 2) * shape.head_dim
    assert not any(k.startswith("decoder.layers.1.") for k in one) if pp == 2 else True
    if shape.is_moe:
        local = {k.split("local_experts.")[1].split(".")[0] for k in one if "local_experts" in k}
        assert len(local) == shape.num_experts // ep
    joined = unshard(shape, pieces, tp=tp, pp=pp, ep=ep)
    assert sorted(joined) == sorted(full)
    for name, t in full.items():
        assert torch.equal(joined[name], t), name


def test_tp_slices_are_the_right_rows(checkpoints):
    """Rank 1's fc1 holds the second half of the gate rows then the second half of the up rows."""
    path = checkpoints["qwen3"]
    shape, hf = _shape(path), read_hf_weights(path)
    piece = shard(shape, hf_to_megatron(shape, hf), tp=2, tp_rank=1)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    half = shape.ffn_hidden_size // 2
    assert torch.equal(piece["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[half:], up[half:]]))
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(piece["decoder.layers.0.self_attention.linear_proj.weight"], o[:, o.shape[1] // 2:])


def test_refusals_name_the_field(checkpoints):
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(ValueError, match="rope type 'llama3'"):
        shape_of({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
    with pytest.raises(ValueError, match="model_type 'gemma3'.*--train-backend fsdp"):
        shape_of({**config, "model_type": "gemma3"})
    with pytest.raises(ValueError, match="attention_bias"):
        shape_of({**config, "attention_bias": True})
    shape = shape_of(config)
    hf = read_hf_weights(checkpoints["llama"])
    with pytest.raises(ValueError, match="no Megatron mapping.*model.extra.weight"):
        hf_to_megatron(shape, {**hf, "model.extra.weight": torch.zeros(1)})
    del hf["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf_to_megatron(shape, hf)


@needs_megatron
def test_logits_equal_transformers(checkpoints):
    """One Megatron rank (TP = PP = EP = 1), packed sequences, each architecture: fp32 tolerance."""
    from milepost.testing.dist import run_ranks
    from milepost.train.megatron.parity import logits_gaps

    [gaps] = run_ranks(logits_gaps, 1, [(str(checkpoints[a]), 1, 1) for a in ARCHS])
    for arch, gap in zip(ARCHS, gaps):
        assert gap["ref_abs_max"] > 1.0  # the comparison is of real, non-trivial logits
        assert gap["max_abs_diff"] < 1e-4, (arch, gap)
