"""Turns a step's chunks into one flat forward pass over the paged KV cache.

The runner owns the model, the KV cache and, for MoE models, a per-slot record of the experts
each token was routed to, kept beside its KV so that a prefix reused from the cache still
reports the experts that produced it.
"""

from __future__ import annotations

import base64

import torch

from milepost.engine.request import Request
from milepost.engine.scheduler import Chunk
from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention
from milepost.models.base import CausalLM, ForwardContext


class ModelRunner:
    def __init__(self, model: CausalLM, kv: PagedKVCache, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.attention = TorchPagedAttention(kv)
        self.block_size = kv.block_size
        self.routed_slots: torch.Tensor | None = None  # [slots, layers, top_k] int32
        if model.moe_top_k > 0:
            n_slots = kv.num_blocks * kv.block_size
            self.routed_slots = torch.full(
                (n_slots, model.num_layers, model.moe_top_k), -1, dtype=torch.int32, device=device
            )

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Compute KV for every chunk; logits [n_sampling_chunks, vocab] fp32 in chunk order."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for c in chunks:
            ids.extend(_token_slice(c.req, c.start, c.start + c.length))
            pos = range(c.start, c.start + c.length)
            positions.extend(pos)
            slots.extend(self._slot(c.req.blocks, p) for p in pos)
            starts.append(starts[-1] + c.length)
        seq_lens = [c.start + c.length for c in chunks]
        max_blocks = max(len(c.req.blocks) for c in chunks)
        tables = [c.req.blocks + [0] * (max_blocks - len(c.req.blocks)) for c in chunks]

        dev = self.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        self.attention.prepare(
            PagedBatch(
                query_start_loc=torch.tensor(starts, dtype=torch.long, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
                block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
                slot_mapping=slot_t,
                query_lens_cpu=[c.length for c in chunks],
                seq_lens_cpu=seq_lens,
            )
        )
        routed = None
        if self.routed_slots is not None:
            routed = torch.full((len(ids), *self.routed_slots.shape[1:]), -1, dtype=torch.int32,
                                device=dev)
        ctx = ForwardContext(attention=self.attention, routed_experts=routed)
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            ctx,
        )
        if routed is not None:
            self.routed_slots[slot_t] = routed
        last_rows = [starts[i + 1] - 1 for i, c in enumerate(chunks) if c.samples]
        if not last_rows:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[last_rows])

    def routed_experts(self, req: Request) -> str | None:
        """int32 [total_len - 1, layers, top_k] for every token that went through the model."""
        if self.routed_slots is None or req.num_computed < req.total_len - 1:
            return None  # aborted before its tokens went through the model
        slots = [self._slot(req.blocks, p) for p in range(req.total_len - 1)]
        data = self.routed_slots[torch.tensor(slots, dtype=torch.long, device=self.device)]
        return base64.b64encode(data.cpu().numpy().tobytes()).decode("ascii")

    def _slot(self, blocks: list[int], pos: int) -> int:
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """req.all_ids[start:end] without concatenating the whole sequence (decode reads one token)."""
    n_prompt = len(req.prompt_ids)
    if start >= n_prompt:
        return req.output_ids[start - n_prompt : end - n_prompt]
    return req.prompt_ids[start:end] + req.output_ids[: max(0, end - n_prompt)]
