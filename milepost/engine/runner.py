"""Turns a step's chunks into one flat forward pass over the paged KV cache.

The runner owns the model, the KV cache, the attention backend (Triton kernels on CUDA, the
torch reference on CPU) and, for MoE models, a per-slot record of the experts each token was
routed to, kept beside its KV so that a prefix reused from the cache still reports the experts
that produced it. On CUDA, all-decode steps replay captured graphs (cuda_graph.py), and so do
speculative verify steps, as one-token rows; prefill and mixed steps run eagerly from arrays built
per chunk (forward_batch.py).
"""

from __future__ import annotations

import base64
from typing import ClassVar

import torch

from milepost.engine.cuda_graph import DecodeGraphs, Feed, fed_tokens
from milepost.engine.forward_batch import (
    build_flat,
    one_token_rows,
    scores_prompt,
    slots_of,
)
from milepost.engine.request import Request
from milepost.engine.scheduler import Chunk
from milepost.lora.serving import AdapterPool
from milepost.models.attention import PagedBatch, PagedKVCache
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.masked_attention import VariantPagedAttention, needs_variant_backend
from milepost.models.triton_attention import (
    AttentionBackendName,
    TritonPagedAttention,
    make_paged_attention,
)


class ModelRunner:
    # Speculative verify steps replay the decode graphs as one-token rows (_verify_in_graphs);
    # a class switch so benchmarks can time the eager verify too.
    verify_in_graphs: ClassVar[bool] = True

    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        device: torch.device,
        attention_backend: AttentionBackendName = "auto",
        cuda_graph_max_bs: int = 0,
        context_length: int | None = None,
        record_routed_experts: bool = True,
    ) -> None:
        """cuda_graph_max_bs > 0 (CUDA only) captures decode graphs up to that batch size."""
        self.model = model
        self.kv = kv
        self.device = device
        self.attention = make_paged_attention(kv, attention_backend)
        self.fast_path = isinstance(self.attention, TritonPagedAttention)
        if needs_variant_backend(model):  # windowed / soft-capped / sink layers (or the fallback)
            self.attention = VariantPagedAttention(self.attention, kv)
        self.block_size = kv.block_size
        self.routed_slots: torch.Tensor | None = None  # [slots, layers, top_k] int32
        if model.moe_top_k > 0 and record_routed_experts:
            n_slots = kv.num_blocks * kv.block_size
            self.routed_slots = torch.full(
                (n_slots, model.num_layers, model.moe_top_k), -1, dtype=torch.int32, device=device
            )
        self.graphs: DecodeGraphs | None = None
        self.verify_replays = 0  # speculative verify steps the decode graphs served
        self.lora: AdapterPool | None = None  # --enable-lora: adapters applied per token (milepost/lora/)
        # Speculative NEXTN (draft_mtp.py): the MTP layer reads the target's final hidden states of
        # every position, kept here per forward as (hidden [T, H], first row of each chunk); its
        # KV pools share the target's blocks, so a partly shared block is copied for them too.
        self.keep_hidden = False
        self.last_hidden: tuple[torch.Tensor, list[int]] | None = None
        self.shadow_pools: list[torch.Tensor] = []
        if cuda_graph_max_bs > 0:
            if device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device; pass --disable-cuda-graph on CPU")
            if context_length is None:
                raise ValueError("CUDA graphs need context_length to size their block tables")
            if not self.fast_path:
                raise ValueError("CUDA graphs need the triton attention backend; disable graphs "
                                 "(--disable-cuda-graph) to run the torch reference backend")
            width = -(-context_length // kv.block_size)
            self.graphs = DecodeGraphs(model, self.attention, device, kv.block_size,
                                       cuda_graph_max_bs, width, self.routed_slots is not None)

    def capture_cuda_graphs(self) -> None:
        """Capture (again) the decode graphs; call after the KV cache or weights were reallocated."""
        if self.graphs is not None:
            self.graphs.reset()
            if self.lora is not None:  # adapters in the graphs: their per-row weights sit in a static buffer
                self.lora.prepare_graphs(self.graphs.max_bs)
                self.graphs.lora = self.lora
            self.graphs.capture()

    def forward(self, chunks: list[Chunk], feed: Feed | None = None) -> torch.Tensor:
        """Compute KV for every chunk; logits [n_sampling_chunks, vocab] in chunk order: fp32,
        or the model's dtype from the decode graphs (cuda_graph.py; every reader casts).

        feed = (tokens on the device, dest, src): input tokens the previous step sampled and
        nobody has read back yet (the overlap schedule); the step's flat input id at position
        dest[j] is tokens[src[j]] (the host-side ids there are placeholders).
        """
        # inference_mode is also what switches the model onto its fused GPU kernels (layers.py,
        # grouped experts); the torch backend stays the reference path throughout.
        with torch.inference_mode() if self.fast_path else torch.no_grad():
            return self._forward(chunks, feed)

    def _forward(self, chunks: list[Chunk], feed: Feed | None) -> torch.Tensor:
        if self.graphs is not None and not self.keep_hidden:
            rows, wanted = chunks, None
            if not all(c.length == 1 for c in chunks):
                if feed is not None or not self._verify_in_graphs(chunks):
                    return self._forward_eager(chunks, feed)
                rows, wanted = one_token_rows(chunks)
            if self.lora is not None and len(rows) <= self.graphs.max_bs:  # the graphs' static LoRA rows
                self.lora.set_graph_batch([self.lora.slot_of(c.req.lora_name) for c in rows])
            logits = self.graphs.run(rows, self._record_routed, feed, wanted)
            if logits is not None:
                self.verify_replays += wanted is not None
                return logits
        return self._forward_eager(chunks, feed)

    def _verify_in_graphs(self, chunks: list[Chunk]) -> bool:
        """A speculative verify step (decodes and verify chunks only) that the decode graphs can
        replay as one-token rows (forward_batch.one_token_rows): the target's weights are read
        once for every proposal, with no eager launches. A verify chunk's rows attend each over
        the whole sequence where the prefill kernel would share one read of it, which costs
        little against the weights at decode lengths."""
        return (self.verify_in_graphs and any(c.verify for c in chunks)
                and all(c.length == 1 or c.verify for c in chunks)
                and sum(c.length for c in chunks) <= self.graphs.max_bs
                and not scores_prompt(chunks))

    def _forward_eager(self, chunks: list[Chunk], feed: Feed | None = None) -> torch.Tensor:
        flat = build_flat(chunks, self.block_size)
        dev = self.device

        def put(a) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        slot_t = put(flat.slots)
        self.attention.prepare(
            PagedBatch(
                query_start_loc=put(flat.query_start_loc),
                seq_lens=put(flat.seq_lens),
                block_tables=put(flat.block_tables),
                slot_mapping=slot_t,
                query_lens_cpu=flat.query_lens,
                seq_lens_cpu=flat.seq_lens.tolist(),
            )
        )
        routed = None
        if self.routed_slots is not None:
            routed = torch.full((len(flat.input_ids), *self.routed_slots.shape[1:]), -1,
                                dtype=torch.int32, device=dev)
        ctx = ForwardContext(attention=self.attention, routed_experts=routed)
        ids = put(flat.input_ids)
        if feed is not None:
            fed_tokens(ids, feed, self.device)
        if self.lora is not None:
            self.lora.set_batch([self.lora.slot_of(c.req.lora_name) for c in chunks], flat.query_lens)
        hidden = self.model.forward(ids, put(flat.positions), ctx)
        if self.keep_hidden:
            self.last_hidden = (hidden, flat.query_start_loc[:-1].tolist())
        if routed is not None:
            self._record_routed(slot_t, routed)
        if not flat.sample_rows:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        rows = torch.tensor(flat.sample_rows, dtype=torch.long).to(dev, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def copy_kv(self, src_block: int, dst_block: int, n: int) -> None:
        """Copy the first n KV entries of src_block into dst_block in every layer (and the routed
        experts recorded beside them): a cached prefix that ends inside a block is reused
        without recomputing it. Enqueued on the current stream, so it runs before the next step."""
        s, d = src_block * self.block_size, dst_block * self.block_size
        pools = [*self.kv.k, *self.kv.v, *self.shadow_pools]
        with torch.no_grad():
            # One multi-tensor launch on CUDA for all layers instead of 2 copies per layer.
            torch._foreach_copy_([t[d : d + n] for t in pools], [t[s : s + n] for t in pools])
            if self.routed_slots is not None:
                self.routed_slots[d : d + n] = self.routed_slots[s : s + n]

    def _record_routed(self, slots: torch.Tensor, routed: torch.Tensor) -> None:
        self.routed_slots[slots] = routed

    def routed_experts(self, req: Request) -> RoutedCopy | None:
        """int32 [total_len - 1, layers, top_k] for every token that went through the model, as a
        copy under way: queued behind the work already launched (a step run ahead by the overlap
        schedule included), read when `RoutedCopy.ready` (no wait for the GPU here). Call before
        the request's blocks are released: later steps may overwrite its slots."""
        if self.routed_slots is None or req.num_computed < req.total_len - 1:
            return None  # aborted before its tokens went through the model
        import numpy as np

        slots = torch.from_numpy(slots_of(req.blocks, np.arange(req.total_len - 1), self.block_size))
        if self.device.type != "cuda":
            return RoutedCopy(self.routed_slots[slots].clone(), None)
        data = self.routed_slots[slots.pin_memory().to(self.device, non_blocking=True)]
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return RoutedCopy(host, done)


class RoutedCopy:
    """A request's routed experts on their way to the host (ModelRunner.routed_experts)."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self.host, self.done = host, done

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def base64(self) -> str:
        """The values as the response carries them (waits for the copy if it is not done)."""
        if self.done is not None:
            self.done.synchronize()
        return base64.b64encode(self.host.numpy().tobytes()).decode("ascii")
