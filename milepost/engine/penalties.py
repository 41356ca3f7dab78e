"""Logit adjustments applied before sampling: SGLang's penalties and `logit_bias`.

As in SGLang, penalties count the request's *output* tokens only (not the prompt):
frequency subtracts `f * count`, presence subtracts `p` once a token appeared, repetition divides
a positive logit (multiplies a negative one) by `r` for every token that appeared. The bias is
added last. Only rows that ask are touched, so a batch without them pays one Python check.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from milepost.engine.sampling_params import SamplingParams


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits: [B, V] fp32 (modified in place and returned); outputs[i]: row i's output ids."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if rows:
        _penalize(logits, rows, [params[i] for i in rows], [outputs[i] for i in rows])
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if rows:
        r_idx, c_idx, vals = [], [], []
        for i in rows:
            for key, value in params[i].logit_bias.items():
                r_idx.append(i)
                c_idx.append(int(key))
                vals.append(value)
        dev = logits.device
        logits.index_put_((to_device(r_idx, dev), to_device(c_idx, dev)),
                          to_device(vals, dev, logits.dtype), accumulate=True)
    return logits


def to_device(values: list | torch.Tensor, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host tensor on `device`. On CUDA through pinned memory, queued like a kernel: a
    copy from pageable memory would first wait for the forward still running on the device."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _penalize(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
              outputs: list[Sequence[int]]) -> None:
    vocab, dev = logits.shape[1], logits.device
    # Padding points at an extra column that is dropped: one scatter counts every row. The rows
    # are laid out with numpy in one pass (a tensor a row cost ~17 ms a step at 256 rows x 200
    # tokens on a 2-core host, this ~2 ms).
    lens = np.fromiter((len(o) for o in outputs), dtype=np.int64, count=len(outputs))
    width = max(1, int(lens.max()))
    ids_np = np.full((len(rows), width), vocab, dtype=np.int64)
    ids_np[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(outputs), dtype=np.int64, count=int(lens.sum()))
    ids = to_device(torch.from_numpy(ids_np), dev)
    counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype, device=dev)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = counts > 0
    index = to_device(rows, dev)
    sub = logits.index_select(0, index)  # [r, V]
    rep = to_device([p.repetition_penalty for p in params], dev, logits.dtype)[:, None]
    if any(p.repetition_penalty != 1.0 for p in params):
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device([p.frequency_penalty for p in params], dev, logits.dtype)[:, None]
    pres = to_device([p.presence_penalty for p in params], dev, logits.dtype)[:, None]
    sub = sub - freq * counts - pres * seen.to(logits.dtype)
    logits.index_copy_(0, index, sub)
