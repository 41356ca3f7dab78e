"""Attention variants the shared backends do not implement: sliding window, logit soft-capping, sinks.

`attend_variant` runs them over either backend the models are given (packed varlen for training,
the paged KV cache for the engine) with plain torch ops, one sequence at a time: the reference
semantics of transformers' eager attention (window: key j is seen from query i when
0 <= i - j < window; softcap: tanh(s / cap) * cap before the mask; sinks: one extra logit per head
in the softmax denominator). Layers without these features keep the backend's own fast `attend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from milepost.models.attention import PagedBatch, PagedKVCache, VarlenCausalAttention


@dataclass(frozen=True)
class Variant:
    """window: sliding window in tokens (None: full); softcap: attention logit cap (None: off);
    sinks: [H] per-head sink logits (gpt-oss), or None."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None


def attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, var: Variant
) -> torch.Tensor:
    """One sequence: q [Lq, H, D] at positions q_pos [Lq]; k/v [Lk, Hkv, D] at positions 0..Lk-1.

    Returns [Lq, H, D]. Causal, plus the variant's window, soft-cap and sinks.
    """
    k_pos = torch.arange(k.shape[0], device=q.device)
    diff = q_pos[:, None] - k_pos[None, :]  # [Lq, Lk]
    allowed = diff >= 0
    if var.window is not None:
        allowed = allowed & (diff < var.window)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H(kv), L, D]
    if var.softcap is None and var.sinks is None:
        out = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=allowed,
                                             scale=scale, enable_gqa=qh.shape[0] != kh.shape[0])[0]
        return out.transpose(0, 1)
    groups = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(groups, 0), vh.repeat_interleave(groups, 0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [H, Lq, Lk]
    if var.softcap is not None:
        scores = torch.tanh(scores / var.softcap) * var.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if var.sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:
        sink = var.sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        both = torch.cat([scores, sink], dim=-1)
        both = both - both.max(dim=-1, keepdim=True).values
        probs = torch.softmax(both, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


def needs_variant_backend(model: object) -> bool:
    """True for models with layers that attend through `attend_variant` (the engine then wraps its
    paged backend in VariantPagedAttention and captures no CUDA graphs)."""
    return not getattr(model, "native", True) or bool(getattr(model, "uses_variant_attention", False))


def attend_variant(
    backend: object, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    var: Variant,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] of the current batch -> [T, H, D] under `var`.

    `backend` is the forward's attention backend: `VarlenCausalAttention` (training, re-scoring)
    or `VariantPagedAttention` (the engine); anything else is refused rather than run unmasked.
    """
    if isinstance(backend, VarlenCausalAttention):
        pieces = []
        for s, e in zip(backend.bounds, backend.bounds[1:]):
            pos = torch.arange(e - s, device=q.device)
            pieces.append(attend_one(q[s:e], k[s:e], v[s:e], pos, scale, var))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if hasattr(backend, "attend_variant"):  # VariantPagedAttention (the engine), or a probe
        return backend.attend_variant(layer_id, q, k, v, scale, var)
    raise TypeError(
        f"{type(backend).__name__} cannot run sliding-window / soft-capped / sink attention; the "
        "engine wraps its backend in VariantPagedAttention and the trainer uses VarlenCausalAttention"
    )


def latent_sequences(
    backend: object, layer_id: int, latent: torch.Tensor
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """For attention over a per-token latent (MLA): store this batch's latent [T, 1, D] where the
    backend keeps KV, and return per sequence (first row in the batch, new rows, the latent of
    all its positions [n, 1, D], the new rows' positions [new])."""
    if isinstance(backend, VarlenCausalAttention):
        return [(s, e - s, latent[s:e], torch.arange(e - s, device=latent.device))
                for s, e in zip(backend.bounds, backend.bounds[1:])]
    if hasattr(backend, "gather_latent"):
        return backend.gather_latent(layer_id, latent)
    raise TypeError(f"{type(backend).__name__} cannot hold a latent KV cache (MLA); the engine wraps "
                    "its backend in VariantPagedAttention and the trainer uses VarlenCausalAttention")


class VariantPagedAttention:
    """The engine's paged backend (Triton or torch) for plain layers, plus `attend_variant` over the
    same cache for layers with a window, soft-cap or sinks (torch ops, one sequence at a time)."""

    def __init__(self, base: object, cache: PagedKVCache) -> None:
        self.base = base
        self.cache = cache
        self._seqs: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (start, q_len, kv slots, q_pos)
        self._slots: torch.Tensor | None = None

    def prepare(self, batch: PagedBatch) -> None:
        self.base.prepare(batch)
        q_lens = batch.query_lens_cpu
        if q_lens is None:
            q_lens = torch.diff(batch.query_start_loc).tolist()
        s_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.tolist()
        bs, dev = self.cache.block_size, batch.block_tables.device
        self._seqs, start = [], 0
        for i, (q, n) in enumerate(zip(q_lens, s_lens)):
            pos = torch.arange(n, device=dev)
            slots = batch.block_tables[i, pos // bs] * bs + pos % bs
            self._seqs.append((start, q, slots, pos[n - q :]))
            start += q
        self._slots = batch.slot_mapping

    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self.base.attend(layer_id, q, k, v, scale)

    def attend_variant(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, var: Variant
    ) -> torch.Tensor:
        if self._slots is None:
            raise RuntimeError("VariantPagedAttention.attend_variant called before prepare(batch)")
        kc, vc = self.cache.k[layer_id], self.cache.v[layer_id]
        kc[self._slots] = k.detach().to(kc.dtype)
        vc[self._slots] = v.detach().to(vc.dtype)
        pieces = []
        for start, n_q, slots, q_pos in self._seqs:
            pieces.append(attend_one(q[start : start + n_q], kc[slots].to(q.dtype), vc[slots].to(q.dtype),
                                     q_pos, scale, var))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def gather_latent(self, layer_id: int, latent: torch.Tensor) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Write the new tokens' latent [T, 1, D] into the K pool; each sequence's full latent."""
        if self._slots is None:
            raise RuntimeError("VariantPagedAttention.gather_latent called before prepare(batch)")
        kc = self.cache.k[layer_id]
        kc[self._slots] = latent.detach().to(kc.dtype)
        return [(start, n_q, kc[slots].to(latent.dtype), q_pos) for start, n_q, slots, q_pos in self._seqs]
