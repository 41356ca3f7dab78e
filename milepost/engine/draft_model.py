"""A small draft model (SGLang's STANDALONE algorithm) that proposes tokens for the target to verify.

The draft keeps its own KV pools with the target's block layout: it reads and writes the same
block ids, so the target's allocator, preemption and prefix cache manage both (no second
allocator). A request's draft KV is valid for its first `draft_computed` positions; a proposal
first catches up the positions it lacks (the whole sequence after admission: a shared prefix is
recomputed into the draft's pools, the same values), then decodes k tokens one forward each. The
draft's tokens are sampled from its own distribution at the request's settings, and that
distribution is kept for the verifier's rule. Its quality only changes the acceptance rate, never
what is returned. On CUDA the one-token draft steps replay CUDA graphs, and so does a catch-up that fits
them (a few positions a request after a verify, as one-token rows); a longer one runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from milepost.engine.cuda_graph import DecodeGraphs
from milepost.engine.forward_batch import FlatBatch, build_flat, one_token_rows
from milepost.engine.request import Request
from milepost.engine.sampling import _race, _truncate
from milepost.engine.scheduler import Chunk
from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.masked_attention import VariantPagedAttention, needs_variant_backend
from milepost.models.triton_attention import AttentionBackendName, TritonPagedAttention, make_paged_attention

Proposal = tuple[list[int], "torch.Tensor | None"]  # tokens, [k, V] draft probabilities (None: greedy)


class DraftModel:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, attention_backend: AttentionBackendName = "auto",
                 catch_up_tokens: int = 2048, cuda_graph_max_bs: int = 0,
                 context_length: int | None = None) -> None:
        """catch_up_tokens: most positions one catch-up forward computes (bounds its activations).
        cuda_graph_max_bs > 0 (CUDA, Triton attention): the one-token draft steps replay
        captured graphs (cuda_graph.py's DecodeGraphs over the draft) up to that batch size."""
        self.model = model
        self.device = device
        self.block_size = block_size
        kv_values = getattr(model, "kv_values", True)
        self.kv = PagedKVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads,
                               model.head_dim, kv_dtype, device, values=kv_values)
        self.attention = make_paged_attention(self.kv, attention_backend)
        if needs_variant_backend(model):
            self.attention = VariantPagedAttention(self.attention, self.kv)
        self.fast_path = self.attention.__class__.__name__ == "TritonPagedAttention"
        self.catch_up_tokens = catch_up_tokens
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_bs > 0 and self.fast_path and context_length:
            width = -(-context_length // block_size)
            self.graphs = DecodeGraphs(model, self.attention, device, block_size, cuda_graph_max_bs,
                                       width, record_routed=False)

    def capture_cuda_graphs(self) -> None:
        """Capture (again) the draft's one-token step graphs, if enabled."""
        if self.graphs is not None:
            self.graphs.reset()
            self.graphs.capture()

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        """k_i tokens for each request (every request's blocks cover total_len + k_i - 1 positions)."""
        with torch.inference_mode() if self.fast_path else torch.no_grad():
            return self._propose(reqs, ks)

    def _propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # Step 0: catch up every position the draft lacks, up to the last token; its last row
        # gives the first proposal. Batches bounded by catch_up_tokens.
        live = list(range(len(reqs)))
        logits = self._catch_up([reqs[i] for i in live])
        self._draw(logits, live, reqs, tokens, probs)
        for j in range(1, max(ks, default=0)):
            live = [i for i in live if ks[i] > j]
            if not live:
                break
            chunks = [Chunk(reqs[i], reqs[i].total_len + j - 1, 1, draft=tokens[i]) for i in live]
            logits = self.graphs.run(chunks) if self.graphs is not None else None
            if logits is None:  # no graphs, or a batch larger than captured
                logits = self._forward(chunks)
            self._draw(logits.float(), live, reqs, tokens, probs)
        for r, k in zip(reqs, ks):
            # Valid draft KV now: through the last token and the proposals before the last one.
            r.draft_computed = r.total_len + k - 1
        return [(t, None if r.params.greedy else torch.stack(p))
                for t, p, r in zip(tokens, probs, reqs)]

    def after_verify(self, req: Request, start_len: int, k: int, accepted: int) -> None:
        """A verify that started at total_len start_len accepted `accepted` of k proposals: the
        draft's KV stays valid through the last token and the accepted proposals it computed."""
        req.draft_computed = min(req.draft_computed, start_len + min(accepted, k - 1))

    def _catch_up(self, reqs: list[Request]) -> torch.Tensor:
        starts = [min(r.draft_computed, r.total_len - 1) for r in reqs]
        chunks = [Chunk(r, s, r.total_len - s) for r, s in zip(reqs, starts)]
        if self.graphs is not None and sum(c.length for c in chunks) <= self.graphs.max_bs:
            # After a verify the draft lacks only the accepted tokens and the target's own one:
            # a few positions a request, replayed as one-token rows of the step graphs.
            one_token, wanted = one_token_rows(chunks)
            logits = self.graphs.run(one_token, rows=wanted)
            if logits is not None:
                return logits.float()
        rows: list[torch.Tensor] = []
        batch: list[Chunk] = []
        size = 0
        for c in chunks:
            n = c.length
            if batch and size + n > self.catch_up_tokens:
                rows.append(self._forward(batch))
                batch, size = [], 0
            # A long sequence alone still runs in one forward (the target's prefill was chunked;
            # the draft is small).
            batch.append(c)
            size += n
        if batch:
            rows.append(self._forward(batch))
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _draw(self, logits: torch.Tensor, live: list[int], reqs: Sequence[Request],
              tokens: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
        draw(logits, live, reqs, tokens, probs)

    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """The draft's logits [len(chunks), V] at each chunk's last position."""
        flat = prepare_draft_batch(self.attention, chunks, self.block_size, self.device)
        hidden = self.model.forward(to_device(flat.input_ids, self.device), to_device(flat.positions, self.device),
                                    ForwardContext(attention=self.attention))
        rows = torch.tensor(flat.sample_rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()


def draw(logits: torch.Tensor, live: list[int], reqs: Sequence[Request],
         tokens: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
    """One token per live request from draft logits [len(live), V], at the request's settings
    (greedy: the argmax; else drawn from the truncated distribution, which is kept in `probs`
    for the verifier's rule)."""
    params = [reqs[i].params for i in live]
    picked = logits.argmax(dim=-1)
    drawn = [j for j, p in enumerate(params) if not p.greedy]
    if drawn:
        temps = torch.tensor([params[j].temperature for j in drawn], device=logits.device)
        p = torch.softmax(logits[drawn].float() / temps[:, None], dim=-1)
        _truncate(p, [params[j] for j in drawn])
        p = p / p.sum(dim=1, keepdim=True)
        picked[drawn] = _race(p.clone(), [reqs[live[j]].generator for j in drawn])
        for row, j in enumerate(drawn):
            probs[live[j]].append(p[row])
    for i, t in zip(live, picked.tolist()):
        tokens[i].append(t)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device, non_blocking=True)


DraftAttention = TorchPagedAttention | TritonPagedAttention | VariantPagedAttention


def prepare_draft_batch(attention: DraftAttention, chunks: list[Chunk], block_size: int,
                        device: torch.device) -> FlatBatch:
    """`chunks` laid out flat, and a draft's paged attention pointed at their blocks (the draft's
    pools share the target's block ids, so the target's block tables serve it)."""
    flat = build_flat(chunks, block_size)
    attention.prepare(PagedBatch(
        query_start_loc=to_device(flat.query_start_loc, device), seq_lens=to_device(flat.seq_lens, device),
        block_tables=to_device(flat.block_tables, device), slot_mapping=to_device(flat.slots, device),
        query_lens_cpu=flat.query_lens, seq_lens_cpu=flat.seq_lens.tolist(),
    ))
    return flat
