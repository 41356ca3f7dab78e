"""Host-side layout of one forward pass, built with numpy per chunk instead of Python lists per token.

`build_flat` gives every array the attention backends and the model need for a step's chunks
(prefill, cached prefixes, decodes mixed); `fill_decode` writes an all-decode step straight into
the persistent (pinned) buffers the CUDA-graph runner copies to the device in one transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from milepost.engine.request import Request
from milepost.engine.scheduler import Chunk


@dataclass
class FlatBatch:
    """input_ids/positions/slots: [T]; query_start_loc: [B+1]; seq_lens: [B]; block_tables: [B, W]."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    query_lens: list[int]
    # Rows whose logits the forward returns, chunk by chunk: the positions that score prompt
    # tokens (Chunk.prompt_rows, prompt log-probs), then the last token of a chunk that samples.
    sample_rows: list[int]


def token_slice(req: Request, start: int, end: int) -> list[int]:
    """req.all_ids[start:end] without concatenating the whole sequence (decode reads one token)."""
    n_prompt = len(req.prompt_ids)
    if start >= n_prompt:
        return req.output_ids[start - n_prompt : end - n_prompt]
    return req.prompt_ids[start:end] + req.output_ids[: max(0, end - n_prompt)]


def chunk_tokens(c: Chunk) -> list[int]:
    """The input ids of a chunk: the request's own tokens, then its proposed ones (c.draft)."""
    end, total = c.start + c.length, c.req.total_len
    if not c.draft:
        return token_slice(c.req, c.start, end)
    return token_slice(c.req, c.start, min(end, total)) + list(c.draft[max(0, c.start - total): end - total])


def slots_of(blocks: Sequence[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position of a sequence whose KV lives in `blocks`."""
    table = np.asarray(blocks, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def build_flat(chunks: Sequence[Chunk], block_size: int) -> FlatBatch:
    ids: list[int] = []
    for c in chunks:
        if c.length == 1 and not c.draft:  # a decode: one token, no slicing (most chunks of a mixed step)
            req, pos = c.req, c.start
            n_prompt = len(req.prompt_ids)
            ids.append(req.output_ids[pos - n_prompt] if pos >= n_prompt else req.prompt_ids[pos])
        else:
            ids.extend(chunk_tokens(c))
    q_lens = [c.length for c in chunks]
    n = len(chunks)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
    widest = max(len(c.req.blocks) for c in chunks)
    # One conversion of the padded block lists (columns past a row's blocks are never read).
    tables = np.array([b if len(b) == widest else b + [0] * (widest - len(b))
                       for b in (c.req.blocks for c in chunks)], dtype=np.int64).reshape(n, widest)
    # Token t of chunk i sits at position starts[i] + (t - cu[i]); its slot through row i's table.
    lens = np.asarray(q_lens, dtype=np.int64)
    row = np.repeat(np.arange(n), lens)
    positions = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(starts - cu[:-1], lens)
    slots = tables[row, positions // block_size] * block_size + positions % block_size
    return FlatBatch(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        slots=slots,
        query_start_loc=cu,
        seq_lens=starts + lens,
        block_tables=tables,
        query_lens=q_lens,
        sample_rows=_logit_rows(chunks, cu),
    )


def _logit_rows(chunks: Sequence[Chunk], cu: np.ndarray) -> list[int]:
    rows: list[int] = []
    for i, c in enumerate(chunks):
        prompt = c.prompt_rows if c.req.logprob_start_len >= 0 else None
        if prompt:
            base = int(cu[i]) - c.start
            rows.extend(base + p for p in prompt)
        if c.samples:
            end = int(cu[i + 1])
            rows.extend(range(end - c.logit_rows, end))
    return rows


def one_token_rows(chunks: Sequence[Chunk]) -> tuple[list[Chunk], list[int]]:
    """Every chunk as one-token rows, position by position, for a decode CUDA graph to replay
    (a verify chunk: the last token and its proposals; a draft model's catch-up), and the rows
    whose logits the eager forward returns for the chunks, in its order (a verify chunk's every
    row, another chunk's last row if it samples; prompt log-prob rows are not served: callers
    check `scores_prompt`). Exact because each layer stores every row's K/V in one launch before
    any row attends, so row t sees its chunk's earlier positions as the causal mask would."""
    rows: list[Chunk] = []
    wanted: list[int] = []
    for c in chunks:
        first = len(rows)
        rows.extend(Chunk(c.req, c.start + t, 1, draft=c.draft) for t in range(c.length))
        if c.samples:
            end = first + c.length
            wanted.extend(range(end - c.logit_rows, end))
    return rows, wanted


def scores_prompt(chunks: Sequence[Chunk]) -> bool:
    """Whether a chunk computes prompt log-probs (rows that `one_token_rows` does not return)."""
    return any(c.req.logprob_start_len >= 0 and c.prompt_rows for c in chunks)


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size >= n (sizes ascending), or None when n exceeds them all."""
    for s in sizes:
        if s >= n:
            return s
    return None


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: every size to 8, then steps of 8 to 64, 16 to 256, 32 beyond."""
    if max_bs < 1:
        raise ValueError(f"cuda graph max batch size must be >= 1; got {max_bs}")
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 65, 8)) + list(range(80, 257, 16)) + list(range(288, max_bs + 32, 32))
    out = sorted({s for s in sizes if s < max_bs} | {max_bs})
    return out


@dataclass
class DecodeBuffers:
    """Views into one pinned int32 host buffer: [ids | positions | slots | seq_lens | tables(W)]."""

    host: np.ndarray  # [max_bs * (4 + W)] int32, backed by pinned memory
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    tables: np.ndarray  # [max_bs, W]

    @classmethod
    def over(cls, host: np.ndarray, max_bs: int, width: int) -> DecodeBuffers:
        if host.shape != (max_bs * (4 + width),):
            raise ValueError(f"host buffer must hold {max_bs * (4 + width)} int32, got {host.shape}")
        parts = [host[i * max_bs : (i + 1) * max_bs] for i in range(4)]
        tables = host[4 * max_bs :].reshape(max_bs, width)
        return cls(host, *parts, tables)


def fill_decode(buf: DecodeBuffers, chunks: Sequence[Chunk], padded_bs: int, block_size: int) -> None:
    """One decode token per chunk into rows [0, n); rows [n, padded_bs) become padding that the
    kernels skip (slot -1 writes no KV, seq_len 0 attends to nothing)."""
    n = len(chunks)
    ids, positions, tables = [], [], []
    widest = 0
    for c in chunks:  # the per-request Python work is kept to list appends (runs every step)
        req, pos = c.req, c.start
        n_prompt = len(req.prompt_ids)
        if c.draft and pos >= n_prompt + len(req.output_ids):  # a draft model's proposal
            ids.append(c.draft[pos - n_prompt - len(req.output_ids)])
        else:
            ids.append(req.output_ids[pos - n_prompt] if pos >= n_prompt else req.prompt_ids[pos])
        positions.append(pos)
        tables.append(req.blocks)
        widest = max(widest, len(req.blocks))
    if widest > buf.tables.shape[1]:
        raise ValueError(f"a request holds {widest} blocks; graphs were captured for {buf.tables.shape[1]}")
    # One conversion of the padded block lists; columns past a row's blocks are never read.
    table = np.array([b if len(b) == widest else b + [0] * (widest - len(b)) for b in tables],
                     dtype=np.int32).reshape(n, widest)
    pos_a = np.array(positions, dtype=np.int32)
    buf.tables[:n, :widest] = table
    buf.ids[:n] = ids
    buf.positions[:n] = pos_a
    buf.slots[:n] = table[np.arange(n), pos_a // block_size] * block_size + pos_a % block_size
    buf.seq_lens[:n] = pos_a + 1
    buf.ids[n:padded_bs] = 0
    buf.positions[n:padded_bs] = 0
    buf.slots[n:padded_bs] = -1
    buf.seq_lens[n:padded_bs] = 0
