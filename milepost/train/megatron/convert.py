"""Hugging Face <-> Megatron-core weight names and layouts, and the split into parallel shards.

`hf_to_megatron` / `megatron_to_hf` map a full state dict (our tensors are never rounded: only
moved, concatenated and split, so a round trip is bit-exact). `shard` cuts the full Megatron
dict into one rank's piece for (tp, pp, ep) sizes and `unshard` joins all ranks' pieces back.
Megatron layouts (local layer spec): linear_qkv holds, per query group, its q heads then k then v;
linear_fc1 is [gate; up]; each TP rank's fc1 is [gate shard; up shard].
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from milepost.train.megatron.shape import ModelShape

Tensors = dict[str, torch.Tensor]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def _qkv(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, hd, h = shape.num_kv_heads, shape.head_dim, q.shape[-1]
    per = shape.num_heads // g
    parts = (q.reshape(g, per * hd, h), k.reshape(g, hd, h), v.reshape(g, hd, h))
    return torch.cat(parts, dim=1).reshape(-1, h)


def _split_qkv(shape: ModelShape, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd, h = shape.num_kv_heads, shape.head_dim, qkv.shape[-1]
    per = shape.num_heads // g
    q, k, v = qkv.reshape(g, (per + 2) * hd, h).split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def _take(hf: Mapping[str, torch.Tensor], name: str, used: set[str]) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"Hugging Face weight {name!r} is missing from the checkpoint")
    used.add(name)
    return hf[name]


def hf_to_megatron(shape: ModelShape, hf: Mapping[str, torch.Tensor]) -> Tensors:
    """Full Megatron state dict (TP = PP = EP = 1 names) from Hugging Face tensors."""
    used: set[str] = set()
    out: Tensors = {"embedding.word_embeddings.weight": _take(hf, "model.embed_tokens.weight", used)}
    for i in range(shape.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        t = lambda n, src=src: _take(hf, src + n, used)
        out[dst + "input_layernorm.weight"] = t("input_layernorm.weight")
        out[dst + "self_attention.linear_qkv.weight"] = _qkv(
            shape, t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"), t("self_attn.v_proj.weight"))
        out[dst + "self_attention.linear_proj.weight"] = t("self_attn.o_proj.weight")
        if shape.qk_layernorm:
            out[dst + "self_attention.q_layernorm.weight"] = t("self_attn.q_norm.weight")
            out[dst + "self_attention.k_layernorm.weight"] = t("self_attn.k_norm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = t("post_attention_layernorm.weight")
        if shape.is_moe and shape.moe_layers[i]:
            out[dst + "mlp.router.weight"] = t("mlp.gate.weight")
            for e in range(shape.num_experts):
                ex, ed = f"mlp.experts.{e}.", f"mlp.experts.local_experts.{e}."
                out[dst + ed + "linear_fc1.weight"] = torch.cat([t(ex + "gate_proj.weight"), t(ex + "up_proj.weight")])
                out[dst + ed + "linear_fc2.weight"] = t(ex + "down_proj.weight")
        else:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")])
            out[dst + "mlp.linear_fc2.weight"] = t("mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = _take(hf, "model.norm.weight", used)
    if not shape.tied_embeddings:
        out["output_layer.weight"] = _take(hf, "lm_head.weight", used)
    elif "lm_head.weight" in hf:
        used.add("lm_head.weight")  # a tied head saved anyway: the embedding is the one copy
    unknown = sorted(set(hf) - used)
    if unknown:
        raise ValueError(f"Hugging Face weights with no Megatron mapping: {unknown[:5]} "
                         f"({len(unknown)} in all); the checkpoint does not match its config.json")
    return out


def megatron_to_hf(shape: ModelShape, meg: Mapping[str, torch.Tensor]) -> Tensors:
    """Hugging Face tensors from a full Megatron state dict (the inverse of `hf_to_megatron`)."""
    out: Tensors = {"model.embed_tokens.weight": meg["embedding.word_embeddings.weight"]}
    for i in range(shape.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = meg[src + "input_layernorm.weight"]
        q, k, v = _split_qkv(shape, meg[src + "self_attention.linear_qkv.weight"])
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v})
        out[dst + "self_attn.o_proj.weight"] = meg[src + "self_attention.linear_proj.weight"]
        if shape.qk_layernorm:
            out[dst + "self_attn.q_norm.weight"] = meg[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = meg[src + "self_attention.k_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = meg[src + "pre_mlp_layernorm.weight"]
        if shape.is_moe and shape.moe_layers[i]:
            out[dst + "mlp.gate.weight"] = meg[src + "mlp.router.weight"]
            for e in range(shape.num_experts):
                ms, hd = f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}."
                gate, up = meg[src + ms + "linear_fc1.weight"].chunk(2)
                out.update({dst + hd + "gate_proj.weight": gate, dst + hd + "up_proj.weight": up,
                            dst + hd + "down_proj.weight": meg[src + ms + "linear_fc2.weight"]})
        else:
            gate, up = meg[src + "mlp.linear_fc1.weight"].chunk(2)
            out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                        dst + "mlp.down_proj.weight": meg[src + "mlp.linear_fc2.weight"]})
    out["model.norm.weight"] = meg["decoder.final_layernorm.weight"]
    if not shape.tied_embeddings:
        out["lm_head.weight"] = meg["output_layer.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# --- parallel shards -------------------------------------------------------------------------------

def _tp_dim(name: str) -> int | None:
    """The dimension TP splits (0: column parallel, 1: row parallel), None = replicated."""
    if name.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def _tp_split(name: str, t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    dim = _tp_dim(name)
    if dim is None or tp == 1:
        return [t] * tp
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each rank gets [its gate rows; its up rows]
        gate, up = t.chunk(2)
        return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))]
    return list(t.chunk(tp, dim=dim))  # qkv: query groups are contiguous, so whole groups per rank


def _tp_join(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    dim = _tp_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The global layer indices of pipeline stage `pp_rank` (even split; sizes checked before)."""
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def shard(shape: ModelShape, full: Mapping[str, torch.Tensor], *, tp: int = 1, pp: int = 1, ep: int = 1,
          tp_rank: int = 0, pp_rank: int = 0, ep_rank: int = 0) -> Tensors:
    """One rank's Megatron state dict: its stage's layers (renumbered), its experts, its TP slice.

    Experts are split by EP only (expert tensor parallel size 1, as the backend builds them).
    """
    layers = stage_layers(shape.num_layers, pp, pp_rank)
    per_ep = shape.num_experts // ep if shape.is_moe else 0
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: Tensors = {}
    for name, t in full.items():
        m = _LAYER.match(name)
        if m is None:
            if name.startswith("embedding.") and not first:
                continue
            if name.startswith(("decoder.final_layernorm", "output_layer")) and not last:
                continue
            out[name] = _tp_split(name, t, tp)[tp_rank]
            continue
        i, rest = int(m.group(1)), m.group(2)
        if i not in layers:
            continue
        e = _EXPERT.match(rest)
        if e is not None:
            idx = int(e.group(1))
            if idx // per_ep != ep_rank:
                continue
            out[f"decoder.layers.{i - layers.start}.mlp.experts.local_experts.{idx % per_ep}.{e.group(2)}"] = t
            continue
        out[f"decoder.layers.{i - layers.start}.{rest}"] = _tp_split(name, t, tp)[tp_rank]
    if shape.tied_embeddings and pp > 1 and last:
        # Megatron keeps a copy of the tied embedding as the last stage's output layer.
        out["output_layer.weight"] = _tp_split("output_layer.weight", full["embedding.word_embeddings.weight"], tp)[tp_rank]
    return out


def unshard(shape: ModelShape, pieces: Mapping[tuple[int, int, int], Mapping[str, torch.Tensor]],
            *, tp: int = 1, pp: int = 1, ep: int = 1) -> Tensors:
    """The full Megatron state dict from every rank's piece, keyed by (tp_rank, pp_rank, ep_rank)."""
    per_ep = shape.num_experts // ep if shape.is_moe else 0
    by_name: dict[str, list[torch.Tensor]] = {}
    for pp_rank in range(pp):
        layers = stage_layers(shape.num_layers, pp, pp_rank)
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                for name, t in pieces[(tp_rank, pp_rank, ep_rank)].items():
                    if name == "output_layer.weight" and shape.tied_embeddings:
                        continue
                    m = _LAYER.match(name)
                    if m is not None:
                        rest = m.group(2)
                        e = _EXPERT.match(rest)
                        if e is not None:
                            rest = f"mlp.experts.local_experts.{ep_rank * per_ep + int(e.group(1))}.{e.group(2)}"
                            if tp_rank:  # experts are not TP-split: rank 0's copy is the one
                                continue
                        elif ep_rank:  # dense weights repeat on every EP rank
                            continue
                        name = f"decoder.layers.{layers.start + int(m.group(1))}.{rest}"
                    elif ep_rank or (pp_rank and name.startswith("embedding.")):
                        continue
                    by_name.setdefault(name, []).append(t)
    return {name: _tp_join(name, parts) for name, parts in by_name.items()}
