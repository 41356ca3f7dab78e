"""Run a model over the engine's paged KV cache the way the engine feeds it, for parity tests.

Sequences advance together: each step gives every unfinished sequence its next chunk (a first
prefill chunk, then one token at a time), so batches mix prefill and decode rows over blocks
that are interleaved in the pool. Returns every position's logits, to compare with a plain
full-sequence forward.
"""

from __future__ import annotations

import torch

from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.masked_attention import VariantPagedAttention, needs_variant_backend


@torch.no_grad()
def paged_logits(
    model: CausalLM, seqs: list[torch.Tensor], first_chunks: list[int], block_size: int = 4
) -> list[torch.Tensor]:
    """seqs: [len_i] token ids; first_chunks[i]: tokens of sequence i in its first forward.

    Returns per sequence logits [len_i, vocab] fp32.
    """
    dtype = next(model.parameters()).dtype
    blocks_each = [-(-len(s) // block_size) for s in seqs]
    kv = PagedKVCache(model.num_layers, sum(blocks_each) + 1, block_size, model.num_kv_heads,
                      model.head_dim, dtype, "cpu", values=getattr(model, "kv_values", True))
    attention = TorchPagedAttention(kv)
    if needs_variant_backend(model):
        attention = VariantPagedAttention(attention, kv)
    # Blocks handed out round-robin so neighbouring blocks belong to different sequences.
    tables: list[list[int]] = [[] for _ in seqs]
    next_block = 1  # block 0 stays unused: padding in block tables points there
    for j in range(max(blocks_each)):
        for i, n in enumerate(blocks_each):
            if j < n:
                tables[i].append(next_block)
                next_block += 1
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        q_lens = [first_chunks[i] if done[i] == 0 else 1 for i in live]
        q_lens = [min(q, len(seqs[i]) - done[i]) for q, i in zip(q_lens, live)]
        batch = PagedBatch.build(q_lens, [done[i] + q for i, q in zip(live, q_lens)],
                                 [tables[i] for i in live], block_size)
        attention.prepare(batch)
        ids = torch.cat([seqs[i][done[i] : done[i] + q] for i, q in zip(live, q_lens)])
        logits = model.compute_logits(model(ids, batch.positions, ForwardContext(attention)))
        for i, piece in zip(live, logits.split(q_lens)):
            out[i].append(piece)
        for i, q in zip(live, q_lens):
            done[i] += q
    return [torch.cat(pieces) for pieces in out]
