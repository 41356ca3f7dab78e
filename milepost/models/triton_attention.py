"""Paged-KV attention on the GPU with our Triton kernels, and the choice of backend by device.

`TritonPagedAttention` has the semantics of `TorchPagedAttention` (attention.py, the CPU/reference
path). A batch whose rows all decode one token runs the split-K decode kernel; any other batch
(prefill chunks, cached prefixes) runs the varlen prefill kernel, except for the one-token rows
at its front (a mixed step's decodes), which run the decode kernel into the same output. `prepare`
does no device sync, and for an all-decode batch nothing in `attend` depends on host values that
change between steps, so the CUDA-graph runner can capture it once per batch size.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from milepost.lowprec.fp8_act import Fp8Act, SplitSum
from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention

AttentionBackendName = Literal["auto", "torch", "triton"]


class TritonPagedAttention:
    """Inference only (no autograd through the kernels); the cache is written in place."""

    # Decode steps hand an FP8 o_proj its input quantized by the attention kernel (an Fp8Act, the
    # same bits as o_proj's own quantize launch; paged_attention.quantizes_out says when). Off
    # until timed on a GPU (benchmarks/lowprec_gpu.py --modes fp8_block+fp8_kv_attn_quant);
    # read at CUDA-graph capture.
    quantize_out: ClassVar[bool] = False

    def __init__(self, cache: PagedKVCache) -> None:
        from milepost.kernels import (
            paged_attention as kernels,  # imports triton: GPU path only
        )

        self.cache = cache
        self.kernels = kernels
        device = cache.k[0].device
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._batch: PagedBatch | None = None
        self._decode = False
        self._splits = 1
        self._tiles: tuple[torch.Tensor, torch.Tensor] | None = None
        # Prefill with no cached prefix anywhere in the batch may run per-sequence SDPA (flash)
        # instead of the paged kernel; chosen by measurement (benchmarks/engine_gpu_profile.py).
        self.sdpa_for_fresh_prefill = False
        self._fresh_bounds: list[int] | None = None
        # A mixed batch's leading one-token rows (decodes) through the decode kernel: in the
        # prefill kernel each takes a BLOCK_M-row tile per query head for one row (a switch
        # only so benchmarks/engine_mixed_profile.py can measure both).
        self.split_mixed_decodes = True
        self._mixed_decodes = 0
        self._mixed_splits = 1
        # q/k norm + RoPE and the KV store in one launch (attend_qkv) instead of three: a
        # switch only so benchmarks can measure both.
        self.fuse_rope_store = True

    def prepare(self, batch: PagedBatch) -> None:
        q_lens = batch.query_lens_cpu
        if q_lens is None:
            raise ValueError("TritonPagedAttention needs PagedBatch.query_lens_cpu (host copy of the layout)")
        self._batch = batch
        self._decode = all(n == 1 for n in q_lens)
        if self._decode:
            self._splits = self.kernels.decode_splits(len(q_lens), self.cache.num_kv_heads, self.num_sms)
            return
        s_lens = batch.seq_lens_cpu
        self._fresh_bounds = None
        if self.sdpa_for_fresh_prefill and s_lens is not None and list(s_lens) == list(q_lens):
            bounds = [0]
            for n in q_lens:
                bounds.append(bounds[-1] + n)
            self._fresh_bounds = bounds
            return
        block_m = self._block_m()
        n_dec = self.kernels.leading_decodes(q_lens) if self.split_mixed_decodes else 0
        self._mixed_decodes = n_dec
        if n_dec:
            self._mixed_splits = self.kernels.decode_splits(n_dec, self.cache.num_kv_heads, self.num_sms)
        seqs, starts = self.kernels.prefill_tiles(q_lens, block_m, first=n_dec)
        dev = batch.block_tables.device
        packed = torch.tensor([seqs, starts], dtype=torch.int32).pin_memory() if dev.type == "cuda" \
            else torch.tensor([seqs, starts], dtype=torch.int32)
        packed = packed.to(dev, non_blocking=True)
        self._tiles = (packed[0], packed[1])

    def _block_m(self) -> int:
        # fp32 (tests) needs twice the shared memory per tile: halve the rows.
        return 64 if self.cache.k[0].dtype == torch.float32 else self.kernels.PREFILL_BLOCK_M

    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] of the new tokens -> [T, H, D]."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("TritonPagedAttention.attend called before prepare(batch)")
        kc, vc = self.cache.k[layer_id], self.cache.v[layer_id]
        # k/v may be row-strided views of a fused qkv GEMM's output: store_kv reads rows by stride.
        self.kernels.store_kv(kc, vc, k, v, batch.slot_mapping)
        if self._fresh_bounds is not None:
            q = q if kc.element_size() == 1 else q.to(kc.dtype)
            return _sdpa_fresh(q, k.to(q.dtype), v.to(q.dtype), scale, self._fresh_bounds)
        return self._attend_stored(layer_id, q, scale)

    def can_attend_qkv(self) -> bool:
        """Whether attend_qkv serves this batch (fresh-prompt SDPA needs k and v as tensors)."""
        return self.fuse_rope_store and self._fresh_bounds is None

    def attend_qkv(self, layer_id: int, qkv: torch.Tensor | SplitSum, num_heads: int,
                   num_kv_heads: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                   eps: float, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                   fp8_out: bool = False) -> torch.Tensor | Fp8Act:
        """qkv: [T, (H + 2 Hkv) D], a fused projection's rows (or their unsummed split parts:
        lowprec/fp8_act.SplitSum) -> [T, H, D]: per-head RMSNorm of q and k (weights None:
        none), RoPE, the KV store, then attention; same values as attend. fp8_out (for an FP8
        o_proj, with `quantize_out` on): a decode step's output may come as [T, H * D] quantized
        per 1 x 128 block (an Fp8Act)."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("TritonPagedAttention.attend_qkv called before prepare(batch)")
        q = self.kernels.rope_store(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, cos, sin,
                                    self.cache.k[layer_id], self.cache.v[layer_id],
                                    batch.slot_mapping)
        return self._attend_stored(layer_id, q, scale, fp8_out and self.quantize_out)

    def _attend_stored(self, layer_id: int, q: torch.Tensor, scale: float,
                       fp8_out: bool = False) -> torch.Tensor | Fp8Act:
        """Attention of q [T, H, D] over the cache, which already holds the new tokens' K/V."""
        batch = self._batch
        kc, vc = self.cache.k[layer_id], self.cache.v[layer_id]
        # An fp8 pool: queries stay in the model dtype, the kernels widen K/V as they load them.
        q = (q if kc.element_size() == 1 else q.to(kc.dtype)).contiguous()
        page = self.cache.block_size
        if self._decode:
            return self.kernels.paged_decode(q, kc, vc, batch.block_tables, batch.seq_lens, scale,
                                             page, self._splits, fp8_out=fp8_out)
        tile_seq, tile_m0 = self._tiles
        out = None
        n = self._mixed_decodes
        if n:  # decode rows first (sequence i is token i), the prefill tiles fill the rest
            out = torch.empty_like(q)
            self.kernels.paged_decode(q[:n], kc, vc, batch.block_tables[:n], batch.seq_lens[:n],
                                      scale, page, self._mixed_splits, out=out[:n])
        return self.kernels.paged_prefill(q, kc, vc, batch.block_tables, batch.seq_lens,
                                          batch.query_start_loc, tile_seq, tile_m0, scale, page,
                                          block_m=self._block_m(), out=out)


def _sdpa_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                bounds: list[int]) -> torch.Tensor:
    """Causal attention within each [bounds[i], bounds[i+1]) span of packed q/k/v (no prefix)."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for s, e in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale, is_causal=True,
                                                             enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1)
    return out


def make_paged_attention(
    cache: PagedKVCache, backend: AttentionBackendName = "auto"
) -> TorchPagedAttention | TritonPagedAttention:
    """`auto`: Triton kernels on CUDA, torch (reference) elsewhere; an explicit name is obeyed."""
    on_cuda = cache.k[0].device.type == "cuda"
    if backend == "auto":
        backend = "triton" if on_cuda else "torch"
    if backend == "torch":
        return TorchPagedAttention(cache)
    if backend == "triton":
        if not on_cuda:
            raise ValueError(
                "--attention-backend triton needs a CUDA device (the KV cache is on "
                f"{cache.k[0].device}); use --attention-backend torch or auto on CPU"
            )
        return TritonPagedAttention(cache)
    raise ValueError(f"--attention-backend must be auto, torch or triton; got {backend!r}")
