"""N-gram proposals: continue the sequence as text went on after the latest earlier occurrence of its tail.

Scope (`--speculative-ngram-scope`) says which texts are searched: `request` the request's own
sequence (prompt, so earlier turns of a conversation, and its output so far); `prompt` also every
other request with the same prompt, in flight or finished recently (a GRPO group's samples, and the
same prompt in a later rollout); `engine` every request the engine saw recently. Each scope keeps
an index from every n-gram (n in [min, max] of the match window) to (sequence, position after its
latest occurrence), extended as tokens arrive (O(window) per token), so a proposal costs a few
dictionary reads, never a scan. The longest matching tail wins. A conversation's next turn, whose
prompt is a finished request's text and a new message, indexes only the new tokens: in request
scope it takes the finished request's index over, in the shared scopes it joins its table and
leaves the history's entries to it. Shared scopes keep at most
`capacity` indexed tokens; the oldest sequences are dropped first. Proposals are point masses
(speculative_sampling.py accepts them exactly), so any text is a valid source: a weight update
invalidates nothing.

Keys and values are plain ints (an n-gram packed into one int, a (sequence, position) pair into
another): an index of int -> int is invisible to Python's garbage collector. With tuples (an n-gram's
tokens; the sequence record and position) every indexed token left ~8 tracked objects behind,
and the growing index made full collections frequent and long: 4-9 of them, up to 80 ms each,
in a 3 s multi-turn run on the H100 (session 31), with every engine step waiting.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from typing import Literal

from milepost.engine.request import Request

Scope = Literal["request", "prompt", "engine"]
SCOPES: tuple[str, ...] = ("request", "prompt", "engine")

# n-gram key (`gram_key`) -> the sequence it occurred in * _AT + the position after its latest
# occurrence there
_Table = dict[int, int]
_DIGIT = 32  # bits of one token in an n-gram's key (token ids are below 2**32 - 1)
_AT = 1 << 40  # positions are below 2**40
_TURN_HEAD = 16  # tokens a finished turn is found by (its next turn's prompt begins with them)
# Host time a rested step may spend indexing (`catch_up`), hidden behind its forward on the GPU
# (a 0.6B decode step at 256 requests takes ~3.5 ms on an H100)
CATCH_UP_S = 1e-3


def gram_key(tokens: list[int]) -> int:
    """One int for an n-gram: its tokens + 1 as base-2**32 digits, the last token lowest (so a
    key extends to the next longer suffix by one digit, and lengths never collide)."""
    key = 0
    for i, tok in enumerate(reversed(tokens)):
        key |= (tok + 1) << (i * _DIGIT)
    return key


class _Seq:
    __slots__ = ("seq", "table", "key", "live", "skip", "src", "done", "num", "__weakref__")

    def __init__(self, table: _Table, key: object, num: int, skip: int = 0, src: int = 0) -> None:
        self.num = num  # its number in index values (the drafter's count of sequences)
        self.seq: list[int] = []  # the request's tokens indexed so far
        self.table = table  # the index its n-grams go into (its own, its prompt's or the engine's)
        self.key = key  # the table's key in the store (None: a request-scope table of its own)
        self.live = True  # False once dropped from the store (its n-grams are gone from the table)
        self.skip = skip  # positions below this are indexed by another sequence, not here:
        self.src = src  # the finished turn this one continues (its number), or 0: a sibling
        self.done = False  # finished (shared scopes: then a later turn may continue it)


class NgramDrafter:
    def __init__(self, min_window: int, max_window: int, scope: Scope = "request",
                 capacity: int = 1 << 18) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram match window must satisfy 1 <= min ({min_window}) <= max "
                             f"({max_window}); fix --speculative-ngram-min/max-match-window-size")
        if scope not in SCOPES:
            raise ValueError(f"--speculative-ngram-scope {scope!r}: use one of {', '.join(SCOPES)}")
        if capacity < 1:
            raise ValueError(f"--speculative-ngram-capacity must be >= 1; got {capacity}")
        self.min_window = min_window
        self.max_window = max_window
        self.scope = scope
        self.capacity = capacity
        # request -> its sequence record; dropped with the request (finished, aborted).
        self._seqs: weakref.WeakKeyDictionary[Request, _Seq] = weakref.WeakKeyDictionary()
        # Shared scopes: the tables by key, and every indexed sequence oldest first (its length
        # counts against `capacity`); finished requests' sequences stay here until dropped.
        self._tables: dict[object, _Table] = {}
        self._ages: OrderedDict[_Seq, int] = OrderedDict()
        self._shared: dict[int, _Seq] = {}  # shared scopes' indexed sequences by number
        # Finished requests' records by their first tokens, for a next turn (`_keep_turn` in
        # request scope, `_continued_shared` in the shared ones).
        self._turns: dict[tuple[int, ...], list[_Seq]] = {}
        self._count = 0
        self._catch_up_from = 0  # where the next `catch_up` starts in its request list
        self.indexed_tokens = 0

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the sequence's tail."""
        if k <= 0:
            return []
        rec = self._record(req)
        self._extend(rec, req)
        seq, table = rec.seq, rec.table
        n_seq = len(seq)
        # The longest tail with an entry, searched shortest first: every n-gram is indexed with
        # all its shorter suffixes (the same position), so once a length has no entry no longer one
        # has, and most steps end after one lookup (per step this is Python work on the host, ~256
        # requests at a time, against a ~3 ms GPU step). n = n_seq too: another text may hold the
        # whole sequence (own text: nothing indexed).
        hit, key, shift = None, 0, 0
        for n in range(1, min(self.max_window, n_seq) + 1):
            key |= (seq[n_seq - n] + 1) << shift  # gram_key of the tail's last n tokens
            shift += _DIGIT
            if n < self.min_window:
                continue
            longer = table.get(key)
            if longer is None:
                break
            hit = longer
        if hit is None:
            return []
        num, pos = divmod(hit, _AT)
        if num != rec.num and num != rec.src:  # another request's text: as far as it goes
            src = self._shared.get(num)
            return src.seq[pos : pos + k] if src is not None else []
        # Where the continuation reaches the tail it goes on repeating itself (a loop
        # of period n_seq - pos proposes k tokens, not only the ones written so far).
        out: list[int] = []
        for i in range(pos, pos + k):
            out.append(seq[i] if i < n_seq else out[i - n_seq])
        return out

    def catch_up(self, reqs: list[Request], budget_s: float = CATCH_UP_S) -> None:
        """Index the tokens the requests have on the host (a slot whose token is still on the
        device is left for the next call), for at most about budget_s seconds: the requests
        left over come first at the next call. The engine calls it on the steps it rests from
        proposing, after their forward is launched, so the indexing runs while the GPU
        computes; otherwise the next proposing step indexed every token of the rest at once
        (at 256 sampled requests on an H100, resting 244 of 256 steps, that cost ~20% of the
        run, session 32). One token for each of 256 requests takes ~1.1 ms on a 2-core CPU."""
        n = len(reqs)
        if not n:
            return
        first = self._catch_up_from % n
        deadline = time.perf_counter() + budget_s
        for i in range(n):
            req = reqs[(first + i) % n]
            rec = self._record(req)
            self._extend(rec, req)
            if time.perf_counter() > deadline:
                self._catch_up_from = first + i + 1
                return
        self._catch_up_from = 0

    def record_finished(self, req: Request) -> None:
        """A finished request's text into a shared scope's index: the tokens since its last
        proposal (or all of it, if it never proposed: decoded while the speculator rested, or
        ineligible), which its siblings may still continue, and a conversation's next turn
        (`_continued_shared`). Request scope keeps an indexed request's table for the
        conversation's next turn (`_continued`)."""
        if self.scope == "request":
            rec = self._seqs.pop(req, None)  # a finished request proposes no more
            if rec is not None:
                self._extend(rec, req)
                self._keep_turn(rec)
            return
        rec = self._record(req)
        self._extend(rec, req)
        if not rec.done and rec.live:
            rec.done = True
            self._turns.setdefault(tuple(rec.seq[:_TURN_HEAD]), []).append(rec)

    def _record(self, req: Request) -> _Seq:
        """The request's sequence record, registered anew if it has none or it was dropped."""
        rec = self._seqs.get(req)
        if rec is None or not rec.live:
            rec = self._seqs[req] = self._register(req)
        return rec

    def _register(self, req: Request) -> _Seq:
        self._count += 1
        if self.scope == "request":
            return self._continued(req.prompt_ids) or _Seq({}, None, self._count)
        prompt = req.prompt_ids
        key = tuple(prompt) if self.scope == "prompt" else None
        table = self._tables.get(key)
        skip, src = self._sibling_indexed(table, prompt), 0
        if not skip:  # the next turn of a conversation: the history's entries are its last turn's
            prev = self._continued_shared(prompt)
            if prev is not None and table in (None, prev.table):
                table, skip, src = prev.table, len(prev.seq), prev.num
        if table is None:
            table = {}
        self._tables[key] = table
        rec = _Seq(table, key, self._count, skip, src)
        self._ages[rec] = 0
        self._shared[rec.num] = rec
        return rec

    def _keep_turn(self, rec: _Seq) -> None:
        """Request scope: a finished request's table, kept (at most `capacity` tokens, the oldest
        dropped first) for a later request whose prompt extends its text: the next turn of a
        conversation, which then indexes only its new tokens, not the whole history again."""
        self._turns.setdefault(tuple(rec.seq[:_TURN_HEAD]), []).append(rec)
        self._ages[rec] = len(rec.seq)
        self.indexed_tokens += len(rec.seq)
        while self.indexed_tokens > self.capacity and len(self._ages) > 1:
            old = next(iter(self._ages))
            self.indexed_tokens -= self._ages.pop(old)
            self._forget_turn(old)

    def _continued_shared(self, prompt: list[int]) -> _Seq | None:
        """Shared scopes: the finished sequence still kept whose text is the longest prefix of
        `prompt` (it stays kept: other turns may branch from it too), or None."""
        best = None
        for rec in self._turns.get(tuple(prompt[:_TURN_HEAD]), ()):
            n = len(rec.seq)
            if (n <= len(prompt) and (best is None or n > len(best.seq)) and rec.live
                    and prompt[n - _TURN_HEAD : n] == rec.seq[-_TURN_HEAD:] and prompt[:n] == rec.seq):
                best = rec
        return best

    def _forget_turn(self, rec: _Seq) -> None:
        head = tuple(rec.seq[:_TURN_HEAD])
        kept = self._turns[head]
        kept.remove(rec)
        if not kept:
            del self._turns[head]

    def _continued(self, prompt: list[int]) -> _Seq | None:
        """The kept turn whose text is the longest prefix of `prompt`, taken out of the store
        (its table and numbers carry on in the new request's record), or None."""
        best = None
        for rec in self._turns.get(tuple(prompt[:_TURN_HEAD]), ()):
            n = len(rec.seq)
            if (n <= len(prompt) and (best is None or n > len(best.seq))
                    and prompt[n - _TURN_HEAD : n] == rec.seq[-_TURN_HEAD:] and prompt[:n] == rec.seq):
                best = rec
        if best is not None:
            self.indexed_tokens -= self._ages.pop(best)
            self._forget_turn(best)
        return best

    def _sibling_indexed(self, table: _Table | None, prompt: list[int]) -> int:
        """Prompt scope: the prompt's length when a live sibling has indexed the prompt already
        (its n-grams are the same; indexing them again cost ~0.5 ms a 128-token prompt, times
        every sample of a GRPO group at the first speculative step), else 0."""
        n = min(self.max_window, len(prompt) - 1)
        if self.scope != "prompt" or n < self.min_window or table is None:
            return 0
        hit = table.get(gram_key(prompt[len(prompt) - 1 - n : len(prompt) - 1]))
        return len(prompt) if hit is not None and hit // _AT in self._shared else 0

    def _extend(self, rec: _Seq, req: Request) -> None:
        """Append the tokens that arrived since the last call and index the n-grams that now have a
        following token (the tail itself is looked up, not indexed: nothing follows it yet)."""
        seq = rec.seq
        n_prompt = len(req.prompt_ids)
        old = len(seq)
        if old < n_prompt:
            seq.extend(req.prompt_ids[old:])
        out = req.output_ids
        known = len(out) - (1 if out and out[-1] < 0 else 0)  # a slot still on the device: -1
        seq.extend(out[max(0, len(seq) - n_prompt) : known])
        self._index(rec, max(old, 1, rec.skip), len(seq))
        if self.scope == "request":
            return
        self._ages[rec] = len(seq) - rec.skip
        self.indexed_tokens += len(seq) - max(old, rec.skip)
        while self.indexed_tokens > self.capacity and len(self._ages) > 1:
            self._drop(next(iter(self._ages)))

    def _index(self, rec: _Seq, start: int, end: int) -> None:
        """Index the n-grams before positions start .. end - 1 of rec's sequence (each key one
        digit longer than the last: `gram_key` inlined, this is the per-token work)."""
        seq, table = rec.seq, rec.table
        lo, hi = self.min_window, self.max_window
        base = rec.num * _AT
        for e in range(start, end):
            key, shift = 0, 0
            for n in range(1, min(hi, e) + 1):
                key |= (seq[e - n] + 1) << shift
                shift += _DIGIT
                if n >= lo:
                    table[key] = base + e

    def _drop(self, rec: _Seq) -> None:
        """Forget the oldest sequence: its n-grams that still point at it (O(len * window))."""
        self.indexed_tokens -= self._ages.pop(rec)
        del self._shared[rec.num]
        rec.live = False
        table, seq = rec.table, rec.seq
        lo, hi = self.min_window, self.max_window
        for e in range(1, len(seq)):
            key, shift = 0, 0
            for n in range(1, min(hi, e) + 1):
                key |= (seq[e - n] + 1) << shift
                shift += _DIGIT
                hit = table.get(key) if n >= lo else None
                if hit is not None and hit // _AT == rec.num:
                    del table[key]
        if rec.done:
            self._forget_turn(rec)
        for other in [o for o in self._ages if o.skip and (
                o.src == rec.num if o.src else o.table is table)]:
            # Later turns that left their history to rec, and siblings that left it the prompt
            # (any sibling may have: all of them, as before): they index it themselves now
            # (before the empty-table check: one with no output yet has nothing else there).
            self._index(other, 1, other.skip)
            self._ages[other] += other.skip
            self.indexed_tokens += other.skip
            other.skip = other.src = 0
        if not table:  # under its prompt's key and those of the turns that joined it
            for key in [k for k, t in self._tables.items() if t is table]:
                del self._tables[key]
