"""DeepSeek-V3 style decoder: multi-head latent attention (MLA) and MoE with shared experts and
grouped sigmoid routing, on the shared skeleton (`DecoderLM`, Qwen3-MoE's stacked experts and names).

MLA caches one latent per token and layer: the normalized compressed KV (kv_lora_rank) and the
roped shared key (qk_rope_head_dim), kept in the paged K pool (no V pool). Attention expands the
latent with kv_b_proj for every cached position of the sequence (the plain, non-absorbed form:
exact, simple, more compute per decode step than absorbed-weight kernels). RoPE as rope.py
implements it (YaRN included, with DeepSeek's mscale on the softmax scale). A checkpoint's
multi-token-prediction layers (mtp.py) are built when its weights hold them (`attach_mtp`): internal
names `mtp.{i}.*`, checkpoint names `model.layers.{num_hidden_layers + i}.*` both ways.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from milepost.models.base import ForwardContext
from milepost.models.layers import GatedMLP, RMSNorm, apply_rotary
from milepost.models.masked_attention import Variant, attend_one, latent_sequences
from milepost.models.mtp import MtpLayer, is_mtp_copy
from milepost.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock, StackedExperts

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
from milepost.models.rope import rope_parameters, yarn_mscale


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs (x0, x1), (x2, x3)... each rotated by one frequency; the result is
    de-interleaved (evens then odds), as transformers writes it. x: [T, heads, r], cos/sin: [T, r]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class LatentAttention(nn.Module):
    """MLA with transformers' module names (q_a_proj/q_b_proj or q_proj, kv_a_proj_with_mqa, ...)."""

    def __init__(self, config: object, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.window = None  # DecoderLM's bookkeeping: MLA has no sliding window
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.interleave = bool(getattr(config, "rope_interleave", True))
        qk = self.nope + self.rope
        self.scale = qk**-0.5
        p = rope_parameters(config)
        if p["rope_type"] != "default" and p.get("mscale_all_dim"):  # YaRN's softmax temperature, squared
            self.scale *= yarn_mscale(float(p["factor"]), float(p["mscale_all_dim"])) ** 2
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; cos/sin: [T, qk_rope_head_dim]."""
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rot = q.view(t, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        rotate = rotate_interleaved if self.interleave else apply_rotary
        q = torch.cat([q_nope, rotate(q_rot, cos, sin)], dim=-1)  # [T, H, nope + rope]
        latent = torch.cat([self.kv_a_layernorm(kv_nope), rotate(k_rot[:, None, :], cos, sin)[:, 0]], dim=-1)
        pieces = []
        for start, n_q, lat, q_pos in latent_sequences(ctx.attention, self.layer_id, latent[:, None, :]):
            n = lat.shape[0]
            kv = self.kv_b_proj(lat[:, 0, : self.kv_rank]).view(n, self.num_heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat([k_nope, lat[:, :, self.kv_rank :].expand(n, self.num_heads, self.rope)], dim=-1)
            pieces.append(attend_one(q[start : start + n_q], k, v, q_pos, self.scale, Variant()))
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [T, H, v_dim]
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))


class GroupedRouter(nn.Module):
    """Sigmoid scores; experts chosen by score + correction bias within the best `topk_group` groups
    (a group's score: the sum of its two best). Kept in fp32 math like transformers'."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        # A checkpoint tensor (updated by DeepSeek's load balancing, not by gradients).
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] fp32 sigmoid scores (what the chosen experts are weighted by)."""
        return torch.sigmoid(x.float() @ self.weight.float().t())

    def choice(self, scores: torch.Tensor) -> torch.Tensor:
        """[T, E] selection scores, -inf outside each token's best groups."""
        biased = scores + self.e_score_correction_bias.float()
        t = biased.shape[0]
        groups = biased.view(t, self.n_group, -1).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(groups).scatter(1, groups.topk(self.topk_group, dim=-1).indices, 1.0)
        mask = keep[:, :, None].expand(t, self.n_group, self.num_experts // self.n_group).reshape(t, -1)
        return biased.masked_fill(mask == 0, float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Selection scores (monotone in what decides the top-k: routing probes rank by them)."""
        return self.choice(self.scores(x))


class GroupedMoeBlock(SparseMoeBlock):
    """Routed experts (stacked, as Qwen3-MoE's) weighted by normalized, scaled sigmoid scores, plus
    always-on shared experts. Records / replays expert ids through the context like Qwen3-MoE."""

    def __init__(self, config: object, layer_id: int) -> None:
        nn.Module.__init__(self)
        self.layer_id = layer_id
        self.top_k: int = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        self.gate = GroupedRouter(config)
        self.experts = StackedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        scores = self.gate.scores(x)  # [T, E] fp32
        forced = ctx.forced_experts if ctx is not None else None
        if forced is not None:
            ids = forced[:, self.layer_id, :].to(torch.int64)
        else:
            ids = self.gate.choice(scores).topk(self.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * self.scaling
        if ctx is not None and ctx.routed_experts is not None:
            ctx.routed_experts[:, self.layer_id, :] = ids.to(ctx.routed_experts.dtype)
        return self.experts(x, ids, w.to(x.dtype)) + self.shared_experts(x)


class DeepseekV3ForCausalLM(Qwen3MoeForCausalLM):
    """DeepseekV3ForCausalLM: MLA in every layer; dense MLP before first_k_dense_replace, MoE after."""

    qk_norm: ClassVar[bool] = False
    kv_values: ClassVar[bool] = False  # the paged cache holds the latent in K pools only

    def __init__(self, config: object) -> None:
        # DecoderLM builds the skeleton (embeddings, norms, RoPE over qk_rope_head_dim = config.head_dim,
        # MLPs via make_mlp); every layer's attention is then MLA.
        super(Qwen3MoeForCausalLM, self).__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = LatentAttention(config, i)
        self.moe_top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.num_kv_heads, self.head_dim = 1, config.kv_lora_rank + config.qk_rope_head_dim
        self.uses_variant_attention = True  # attention over the latent: torch ops, per sequence

    def check_config(self, config: object) -> None:
        if config.n_routed_experts % config.n_group:
            raise ValueError(f"n_routed_experts ({config.n_routed_experts}) must divide into n_group "
                             f"({config.n_group}) groups")

    def layer_window(self, config: object, layer_id: int) -> int | None:
        return None

    def make_mlp(self, config: object, layer_id: int) -> nn.Module:
        if layer_id >= config.first_k_dense_replace:
            return GroupedMoeBlock(config, layer_id)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def fuse_projections(self) -> None:
        """Engine: gate/up of the dense layers' MLPs into one GEMM (MLA's projections stay apart)."""
        if self._fused:
            return
        for i in range(self.num_layers):
            self.fuse_layer(i)

    def fuse_layer(self, i: int) -> None:
        self.hf_weight_names()
        if isinstance(self.model.layers[i].mlp, GatedMLP):
            self._fuse(f"model.layers.{i}.mlp", self.model.layers[i].mlp, ("gate_proj", "up_proj"), "gate_up_proj")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> tuple[int, int]:
        """(MLA latent bytes per token over all layers, what standard attention with the same heads
        and head sizes would cache: K of nope + rope and V of v_head_dim per head)."""
        elem = torch.empty((), dtype=dtype).element_size()
        c = self.hf_config
        mla = self.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * elem
        mha = self.num_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * elem
        return mla, mha

    # --- multi-token prediction (the NEXTN draft) ----------------------------------------------

    supports_mtp: ClassVar[bool] = True

    def attach_mtp(self, n: int) -> None:
        """Build n MTP layers (registry.load_native does it when the checkpoint holds them). Each
        attends over its own paged cache (layer 0 of the drafter's pool); MoE past
        first_k_dense_replace like the decoder's layers at those indices."""
        config = self.hf_config
        self.mtp = nn.ModuleList()
        for i in range(n):
            layer = MtpLayer(config, self.make_mlp(config, self.num_layers + i))
            layer.self_attn = LatentAttention(config, 0)
            self.mtp.append(layer)
        self._hf_names = None  # the names now include the MTP layers'

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp) if hasattr(self, "mtp") else 0

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    ctx: ForwardContext, layer: int = 0) -> torch.Tensor:
        """One MTP step: input_ids [T] (tokens p + 1), hidden [T, H] (states at p), positions [T]
        (p) -> [T, H] normed states; `compute_logits` of them gives the predictions of p + 2."""
        e = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, e.dtype)
        return self.mtp[layer].predict(e, hidden, cos, sin, ctx)

    def skip_checkpoint_name(self, name: str) -> bool:
        """DeepSeek's copies of the embedding and LM head under an MTP layer: read by no one (the
        MTP layer uses the target's own), so a disk update passes over them as loading does."""
        return self.num_mtp_layers > 0 and is_mtp_copy(name, self.num_layers)

    def _mtp_hf(self, name: str) -> str:
        """Internal `mtp.{i}.rest` -> checkpoint `model.layers.{N + i}.rest` (others unchanged)."""
        if not name.startswith("mtp."):
            return name
        i, rest = name[4:].split(".", 1)
        return f"model.layers.{self.num_layers + int(i)}.{rest}"

    def _expand_hf_names(self, param_names: list[str]) -> list[str]:
        return super()._expand_hf_names([self._mtp_hf(n) for n in param_names])

    def hf_tensors(self, param_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return super().hf_tensors(self._mtp_hf(param_name), full)

    def _experts(self, layer: str, hf_name: str) -> StackedExperts:
        i = int(layer) - self.num_layers
        if 0 <= i < self.num_mtp_layers and isinstance(self.mtp[i].mlp, SparseMoeBlock):
            return self.mtp[i].mlp.experts
        return super()._experts(layer, hf_name)

    def weight_view(self, hf_name: str) -> torch.Tensor:
        m = _LAYER_NAME.fullmatch(hf_name)
        if m and int(m.group(1)) >= self.num_layers and ".mlp.experts." not in hf_name:
            if self._hf_names is None:
                self.hf_weight_names()
            if hf_name not in self._hf_name_set:
                raise self.unknown_weight(hf_name)
            return self.get_parameter(f"mtp.{int(m.group(1)) - self.num_layers}.{m.group(2)}").detach()
        return super().weight_view(hf_name)
