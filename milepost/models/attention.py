"""CPU/reference attention backends: a paged KV cache for the engine, packed varlen for full sequences.

Both implement `AttentionBackend` from base.py with torch SDPA. They favour clarity over speed: on
CUDA the engine runs `TritonPagedAttention` (triton_attention.py), which reproduces the semantics of
`TorchPagedAttention` (bottom-right aligned causal mask over each sequence's cached prefix plus its
new tokens, GQA by head groups) and is tested against it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PagedKVCache:
    """Per-layer K and V pools of `num_blocks * block_size` slots; slot = block_id * block_size + offset."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        values: bool = True,
    ) -> None:
        """values=False: K pools only (MLA keeps one latent per token there; `v` stays empty)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k] if values else []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


@dataclass
class PagedBatch:
    """Layout of one forward over the paged cache (B sequences, T new tokens in sequence order).

    query_start_loc: [B+1] int64, cumulative count of new tokens per sequence.
    seq_lens: [B] int64, KV length of each sequence after this forward (cached + new tokens).
    block_tables: [B, max_blocks] int64, each sequence's block ids in order, padded with 0.
    slot_mapping: [T] int64, cache slot of each new token.
    The *_cpu lists mirror the tensors on the host so `prepare` needs no device sync; `positions`
    ([T] int64) is filled by `build` for the caller's convenience (the model needs it, attention not).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens_cpu: list[int] | None = None
    query_lens_cpu: list[int] | None = None
    positions: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedBatch:
        """Batch for sequences that each append query_lens[i] tokens, ending at length seq_lens[i]."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables need one (non-empty) entry per sequence")
        positions, slots = [], []
        for q, n, blocks in zip(query_lens, seq_lens, block_tables):
            if not 1 <= q <= n:
                raise ValueError(f"each sequence needs 1 <= query_len <= seq_len, got {q} and {n}")
            if len(blocks) * block_size < n:
                raise ValueError(f"block table {list(blocks)} holds fewer than seq_len={n} slots")
            pos = torch.arange(n - q, n)
            table = torch.as_tensor(list(blocks), dtype=torch.int64)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max(len(b) for b in block_tables)
        padded = [list(b) + [0] * (width - len(b)) for b in block_tables]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        return cls(
            query_start_loc=torch.tensor(cu, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
            slot_mapping=torch.cat(slots).to(device),
            seq_lens_cpu=list(seq_lens),
            query_lens_cpu=list(query_lens),
            positions=torch.cat(positions).to(device),
        )


@dataclass
class _PrefillSeq:
    token_start: int
    query_len: int
    kv_slots: torch.Tensor  # [seq_len] slots of positions 0..seq_len-1
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None when query_len == seq_len (plain causal)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New K/V entries in the pool's dtype; an fp8 pool saturates at +-448 (the cast alone does
    not promise to)."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-448.0, 448.0)
    return x.detach().to(dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw) -> torch.Tensor:
    """q: [N, H, Lq, D], k/v: [N, Hkv, Lk, D]; GQA handled by SDPA itself (no repeated K/V copies)."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **kw)


# Sequences with at most this many new tokens share one padded SDPA call (_ShortQueries); longer
# chunks (prompts) run one call each, where padding to the longest would waste more than it saves.
SHORT_QUERY = 16


class TorchPagedAttention:
    """Paged-KV attention with torch ops: decode rows vectorized, short chunks (verify) padded into
    one call, longer chunks (prefill) one sequence at a time.

    Inference only: new K/V are written into the cache detached, so no gradient flows through it
    (train with `VarlenCausalAttention`).
    """

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._batch: PagedBatch | None = None

    def prepare(self, batch: PagedBatch) -> None:
        """Precompute gather indices and masks once per forward; every layer reuses them."""
        bs = self.cache.block_size
        q_lens = batch.query_lens_cpu
        if q_lens is None:
            q_lens = torch.diff(batch.query_start_loc).tolist()
        s_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.tolist()
        if len(q_lens) != len(s_lens) or any(not 1 <= q <= n for q, n in zip(q_lens, s_lens)):
            raise ValueError(f"PagedBatch needs 1 <= query_len <= seq_len per sequence: {q_lens} vs {s_lens}")
        device = batch.block_tables.device
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        dec = [i for i, q in enumerate(q_lens) if q == 1]
        short = [i for i, q in enumerate(q_lens) if 1 < q <= SHORT_QUERY]
        pre = [i for i, q in enumerate(q_lens) if q > SHORT_QUERY]

        self._dec_tokens: torch.Tensor | None = None
        if dec:
            idx = torch.tensor(dec, dtype=torch.int64, device=device)
            lmax = max(s_lens[i] for i in dec)
            j = torch.arange(lmax, device=device)
            tables = batch.block_tables.index_select(0, idx)
            self._dec_slots = tables[:, j // bs] * bs + j % bs  # [Bd, Lmax]
            # Padded positions point at block 0 (any valid slot); the mask drops them.
            self._dec_mask = (j[None, :] < batch.seq_lens.index_select(0, idx)[:, None])[:, None, None, :]
            self._dec_tokens = torch.tensor([starts[i] for i in dec], dtype=torch.int64, device=device)
        self._short: _ShortQueries | None = None
        if short:
            self._short = _ShortQueries.build(batch, short, [q_lens[i] for i in short],
                                              [s_lens[i] for i in short], starts, bs)
        self._prefill: list[_PrefillSeq] = []
        for i in pre:
            q, n = q_lens[i], s_lens[i]
            pos = torch.arange(n, device=device)
            slots = batch.block_tables[i, pos // bs] * bs + pos % bs
            mask = None
            if q < n:  # causal mask aligned bottom-right: query r sits at position n - q + r
                rows = torch.arange(n - q, n, device=device)
                mask = pos[None, :] <= rows[:, None]
            self._prefill.append(_PrefillSeq(starts[i], q, slots, mask))
        self._pre_tokens = None
        if self._prefill:
            ranges = [torch.arange(p.token_start, p.token_start + p.query_len) for p in self._prefill]
            self._pre_tokens = torch.cat(ranges).to(device)
        self._batch = batch

    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] of the new tokens -> [T, H, D]."""
        if self._batch is None:
            raise RuntimeError("TorchPagedAttention.attend called before prepare(batch)")
        kc, vc = self.cache.k[layer_id], self.cache.v[layer_id]
        slots = self._batch.slot_mapping
        kc[slots] = to_cache(k, kc.dtype)
        vc[slots] = to_cache(v, vc.dtype)

        parts = []  # (token indices, outputs) of each group of sequences
        if self._dec_tokens is not None:
            qd = q.index_select(0, self._dec_tokens)[:, :, None, :]  # [Bd, H, 1, D]
            kd = kc[self._dec_slots].transpose(1, 2).to(q.dtype)  # [Bd, Hkv, Lmax, D]
            vd = vc[self._dec_slots].transpose(1, 2).to(q.dtype)
            parts.append((self._dec_tokens, _sdpa(qd, kd, vd, scale, attn_mask=self._dec_mask)[:, :, 0, :]))
        if self._short is not None:
            parts.append((self._short.tokens, self._short.attend(q, kc, vc, scale)))
        if self._prefill:
            pieces = []
            for p in self._prefill:
                qp = q[p.token_start : p.token_start + p.query_len].transpose(0, 1)[None]
                kp = kc[p.kv_slots].transpose(0, 1)[None].to(q.dtype)
                vp = vc[p.kv_slots].transpose(0, 1)[None].to(q.dtype)
                o = _sdpa(qp, kp, vp, scale, attn_mask=p.mask, is_causal=p.mask is None)
                pieces.append(o[0].transpose(0, 1))
            parts.append((self._pre_tokens, torch.cat(pieces)))
        if len(parts) == 1:
            return parts[0][1]  # one group holds every sequence: its tokens are the batch's, in order
        out = q.new_zeros(q.shape)
        for tokens, o in parts:
            out = out.index_copy(0, tokens, o)
        return out


@dataclass
class _ShortQueries:
    """Sequences with a few new tokens each (a speculative verify chunk, a short prompt or chunk):
    one SDPA call over their queries padded to the longest, the causal mask aligned bottom-right
    per sequence, instead of a call per sequence (at 256 verify chunks of 4 tokens on a CPU the
    per-sequence calls made a verify step cost ~5 plain steps)."""

    tokens: torch.Tensor  # [sum q] the batch's token index of each real query, sequence by sequence
    rows: torch.Tensor  # [sum q] its row in the padded [B * Qmax] query block
    slots: torch.Tensor  # [B, Lmax] cache slots of positions 0 .. Lmax - 1 (padding: any slot)
    mask: torch.Tensor  # [B, 1, Qmax, Lmax] bool
    qmax: int

    @classmethod
    def build(cls, batch: PagedBatch, seqs: list[int], q_lens: list[int], s_lens: list[int],
              starts: list[int], bs: int) -> _ShortQueries:
        device = batch.block_tables.device
        idx = torch.tensor(seqs, dtype=torch.int64, device=device)
        qmax, lmax = max(q_lens), max(s_lens)
        j = torch.arange(lmax, device=device)
        slots = batch.block_tables.index_select(0, idx)[:, j // bs] * bs + j % bs
        ql = torch.tensor(q_lens, dtype=torch.int64, device=device)[:, None]
        r = torch.arange(qmax, device=device)[None, :]
        real = r < ql  # [B, Qmax]
        pos = batch.seq_lens.index_select(0, idx)[:, None] - ql + r  # query r's position
        # A padding row sees key 0 alone: a row with no key at all would be NaN (then dropped).
        mask = torch.where(real[:, :, None], j[None, None, :] <= pos[:, :, None], j[None, None, :] == 0)
        # Plain ints, one tensor each: a tensor a sequence cost ~3 us apiece, 256 a verify step.
        tokens = [starts[i] + t for i, q in zip(seqs, q_lens) for t in range(q)]
        rows = [b * qmax + t for b, q in enumerate(q_lens) for t in range(q)]
        return cls(torch.tensor(tokens, dtype=torch.int64, device=device),
                   torch.tensor(rows, dtype=torch.int64, device=device), slots, mask[:, None], qmax)

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, H, D] the batch's queries -> [sum q, H, D] the outputs of these sequences' tokens."""
        b, heads, dim = self.slots.shape[0], q.shape[1], q.shape[2]
        padded = q.new_zeros(b * self.qmax, heads, dim).index_copy(0, self.rows, q.index_select(0, self.tokens))
        qs = padded.view(b, self.qmax, heads, dim).transpose(1, 2)  # [B, H, Qmax, D]
        ks = kc[self.slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, Lmax, D]
        vs = vc[self.slots].transpose(1, 2).to(q.dtype)
        o = _sdpa(qs, ks, vs, scale, attn_mask=self.mask)  # [B, H, Qmax, D]
        return o.transpose(1, 2).reshape(b * self.qmax, heads, dim).index_select(0, self.rows)


class VarlenCausalAttention:
    """Packed sequences without a cache: causal attention within each [cu[i], cu[i+1]) span.

    On CUDA in bf16/fp16 one FlashAttention-2 varlen call covers every sequence, forward and
    backward (milepost/kernels/varlen_flash.py); elsewhere (CPU, fp32) the reference path runs one
    SDPA call per sequence over views from a single `split` (one gradient node, not one full-size
    slice gradient per sequence).
    """

    def __init__(self, cu_seqlens: torch.Tensor) -> None:
        bounds = [int(x) for x in cu_seqlens.tolist()]  # one host sync per forward, not per layer
        if len(bounds) < 2 or bounds[0] != 0 or any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"cu_seqlens must start at 0 and strictly increase, got {bounds}")
        self.bounds = bounds
        self.lengths = [b - a for a, b in itertools.pairwise(bounds)]
        self.max_len = max(self.lengths)
        self._cu32: torch.Tensor | None = None

    # A compiled training layer calls this eagerly: train/compile.py marks it with
    # torch.compiler.disable when it compiles (not here: that imports dynamo, ~1.5 s per process).
    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]; T must equal cu_seqlens[-1]."""
        if q.shape[0] != self.bounds[-1]:
            raise ValueError(f"got {q.shape[0]} tokens but cu_seqlens covers {self.bounds[-1]}")
        from milepost.kernels.varlen_flash import (
            flash_varlen_causal,
            flash_varlen_supported,
        )

        if flash_varlen_supported(q, k):
            if self._cu32 is None or self._cu32.device != q.device:  # built once, shared by all layers
                self._cu32 = torch.tensor(self.bounds, dtype=torch.int32, device=q.device)
            return flash_varlen_causal(q, k, v, self._cu32, self.max_len, scale)
        if len(self.lengths) == 1:
            return _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         scale, is_causal=True)[0].transpose(0, 1)
        pieces = [
            _sdpa(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                  scale, is_causal=True)[0].transpose(0, 1)
            for qs, ks, vs in zip(q.split(self.lengths), k.split(self.lengths), v.split(self.lengths))
        ]
        return torch.cat(pieces)
