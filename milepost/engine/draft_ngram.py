"""N-gram proposals: continue the sequence as it went on after the latest earlier occurrence of its tail.

The lookup covers the request's whole sequence (prompt, so earlier turns of a conversation, and its
output so far). Each request keeps an index from every n-gram (n in [min, max] of the match
window) to the position after its latest occurrence, extended as tokens arrive (O(window) per
token), so a proposal costs a few dictionary reads, not a scan of the sequence. The longest
matching tail wins. Proposals are point masses (speculative_sampling.py accepts them exactly).
"""

from __future__ import annotations

import weakref

from milepost.engine.request import Request


class _Index:
    __slots__ = ("after", "seq", "__weakref__")

    def __init__(self) -> None:
        self.seq: list[int] = []  # the request's tokens indexed so far
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest occurrence


class NgramDrafter:
    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram match window must satisfy 1 <= min ({min_window}) <= max "
                             f"({max_window}); fix --speculative-ngram-min/max-match-window-size")
        self.min_window = min_window
        self.max_window = max_window
        # Dropped with the request (finished, aborted): no bookkeeping on the engine's side.
        self._indexes: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the sequence's tail."""
        if k <= 0:
            return []
        idx = self._indexes.get(req)
        if idx is None:
            idx = self._indexes[req] = _Index()
        self._extend(idx, req)
        seq = idx.seq
        n_seq = len(seq)
        for n in range(min(self.max_window, n_seq - 1), self.min_window - 1, -1):
            pos = idx.after.get(tuple(seq[n_seq - n :]))
            if pos is not None:
                # Where the continuation reaches the tail it goes on repeating itself (a loop
                # of period n_seq - pos proposes k tokens, not only the ones written so far).
                out: list[int] = []
                for i in range(pos, pos + k):
                    out.append(seq[i] if i < n_seq else out[i - n_seq])
                return out
        return []

    def _extend(self, idx: _Index, req: Request) -> None:
        """Append the tokens that arrived since the last call and index the n-grams that now have a
        following token (the tail itself is looked up, not indexed: nothing follows it yet)."""
        seq = idx.seq
        n_prompt = len(req.prompt_ids)
        old = len(seq)
        if old < n_prompt:
            seq.extend(req.prompt_ids[old:])
        seq.extend(req.output_ids[max(0, len(seq) - n_prompt):])
        after = idx.after
        lo, hi = self.min_window, self.max_window
        # Positions e whose preceding n-grams are indexed now: those with a token at e.
        for e in range(max(old, 1), len(seq)):
            for n in range(lo, min(hi, e) + 1):
                after[tuple(seq[e - n : e])] = e
