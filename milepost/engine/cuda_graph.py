"""CUDA graphs for decode steps: one graph per captured batch size, all in one memory pool.

A decode step is launch-bound (hundreds of small kernels for ~3 ms of GPU work), so the whole
forward (embedding to logits) is captured once per batch size and replayed. Inputs live in
persistent device buffers filled by a single host-to-device copy per step; a batch is padded to
the next captured size with rows the kernels skip (slot -1, seq_len 0). Graphs hold the KV
cache's and the weights' addresses: whoever reallocates either must call `reset` (weight updates
copy in place, so they need not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from milepost.engine.forward_batch import (
    DecodeBuffers,
    capture_sizes,
    fill_decode,
    padded_size,
)
from milepost.engine.scheduler import Chunk
from milepost.models.attention import PagedBatch
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.llama import DecoderLM

log = logging.getLogger(__name__)
# (tokens sampled on the device, positions in the step's flat input ids, source row of each)
Feed = tuple[torch.Tensor, list[int], list[int]]


def fed_tokens(ids: torch.Tensor, feed: Feed, device: torch.device) -> None:
    """ids[dest] = tokens[src], on the device (no read-back of the previous step's samples)."""
    tokens, dest, src = feed
    n = len(dest)
    if dest == src == list(range(n)):  # the usual case: a decode step of the same requests
        ids[:n].copy_(tokens[:n])
        return
    index = torch.tensor([dest, src], dtype=torch.long)
    if device.type == "cuda":  # pinned: a pageable copy would wait for all queued work
        index = index.pin_memory().to(device, non_blocking=True)
    ids.index_copy_(0, index[0], tokens.index_select(0, index[1]).to(ids.dtype))


class DecodeGraphs:
    # DecoderLM models: the graphs return the LM head's output in the model dtype (see _forward);
    # a class switch only so benchmarks/engine_mixed_profile.py can measure both.
    raw_logits = True

    def __init__(self, model: CausalLM, attention: object, device: torch.device, block_size: int,
                 max_bs: int, max_blocks_per_seq: int, record_routed: bool) -> None:
        self.model = model
        self.attention = attention
        self.device = device
        self.block_size = block_size
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        width = max_blocks_per_seq
        n = self.max_bs * (4 + width)
        self._host_t = torch.zeros(n, dtype=torch.int32).pin_memory()
        self.host = DecodeBuffers.over(self._host_t.numpy(), self.max_bs, width)
        self._dev = torch.zeros(n, dtype=torch.int32, device=device)
        mb = self.max_bs
        self.ids, self.positions, self.slots, self.seq_lens = (self._dev[i * mb:(i + 1) * mb] for i in range(4))
        self.tables = self._dev[4 * mb:].view(mb, width)
        self.query_start_loc = torch.arange(mb + 1, dtype=torch.int32, device=device)
        self.routed = None
        if record_routed:
            self.routed = torch.full((mb, model.num_layers, model.moe_top_k), -1, dtype=torch.int32,
                                     device=device)
        self._copied = torch.cuda.Event()
        self.lora = None  # an AdapterPool (stacked kernel): set by the runner before capture
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _prepare(self, bs: int) -> None:
        self.attention.prepare(PagedBatch(
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.tables[:bs], slot_mapping=self.slots[:bs],
            query_lens_cpu=[1] * bs, seq_lens_cpu=None,
        ))

    def _forward(self, bs: int) -> torch.Tensor:
        routed = self.routed[:bs] if self.routed is not None else None
        ctx = ForwardContext(attention=self.attention, routed_experts=routed)
        if self.lora is not None:
            self.lora.capturing(bs)
        hidden = self.model.forward(self.ids[:bs], self.positions[:bs], ctx)
        if self.raw_logits and type(self.model).compute_logits is DecoderLM.compute_logits:
            # The LM head's output as is: compute_logits would only add a copy to fp32, which
            # sample() and the prompt log-probs make themselves when they need it (the fused
            # sampler reads the model dtype): the same values, one [bs, vocab] pass fewer.
            return self.model.lm_head(hidden)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()  # the same mode the runner replays in (it selects the fused kernels)
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its pool memory."""
        self.host.slots[:] = -1  # padding everywhere: capture writes no KV and reads none
        self.host.seq_lens[:] = 0
        self.host.ids[:] = 0
        self._dev.copy_(self._host_t)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self._prepare(bs)
            self._forward(bs)  # warm-up: compiles kernels, lazy inits outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bs] = self._forward(bs)
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def reset(self) -> None:
        """Drop the graphs (after the KV cache or weights were reallocated); `capture` again."""
        self._graphs.clear()
        self._logits.clear()

    def run(self, chunks: Sequence[Chunk],
            record: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
            feed: Feed | None = None, rows: Sequence[int] | None = None) -> torch.Tensor | None:
        """Logits [sampling chunks, vocab] for an all-decode step, or None when it is too large;
        in the model's dtype for DecoderLM models (the LM head's output), else fp32.

        The result is a view of the graph's output buffer: valid until the next replay.
        `record(slots [n], routed [n, layers, top_k])` stores the experts of the real rows.
        `feed`: input tokens still on the device (see ModelRunner.forward).
        `rows`: the chunks whose logits to return, ascending (default: those that sample); for
        chunks split by forward_batch.one_token_rows.
        """
        n = len(chunks)
        bs = padded_size(n, self.sizes)
        if bs is None or not self._graphs:
            return None
        self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        fill_decode(self.host, chunks, bs, self.block_size)
        self._dev.copy_(self._host_t, non_blocking=True)
        self._copied.record()
        if feed is not None:  # after the copy, which wrote placeholders there
            fed_tokens(self.ids, feed, self.device)
        self._graphs[bs].replay()
        if record is not None and self.routed is not None:
            record(self.slots[:n].long(), self.routed[:n])
        logits = self._logits[bs]
        if rows is None:
            rows = [i for i, c in enumerate(chunks) if c.samples]
        if len(rows) == n:
            return logits[:n]
        return logits[torch.tensor(rows, dtype=torch.long, device=self.device)]
