"""Continuous batching: which tokens of which requests go into the next forward pass.

Every step, each running request that is fully prefilled decodes one token; the rest of the
step's token budget (`chunked_prefill_size`) goes to prefill chunks, first of requests already
mid-prefill, then of newly admitted ones, so a long prompt never stalls the decodes. A request
admitted from the queue first reuses the longest cached prefix: whole cached blocks are shared,
and where the prefix ends inside a cached block, its matching KV entries are copied into a fresh
block of the request (`copy_kv`, a device-side copy instead of recomputing those tokens; they
count as cached tokens). When blocks run out the prefix
cache is evicted first, then the newest running requests are preempted: their KV is dropped and
they wait to be recomputed later (their generated tokens are kept).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from milepost.engine.block_pool import BlockPool
from milepost.engine.radix_cache import RadixCache
from milepost.engine.request import ReqState, Request


# Waiting requests deferred in one step at most (each costs a prefix match): past this the
# queue waits, as it would without deferral.
_MAX_DEFERRED = 64


@dataclass
class Chunk:
    """`length` tokens of `req` starting at position `start` are computed in this step."""

    req: Request
    start: int
    length: int
    # Speculative decoding (speculative.py): tokens proposed after the request's own, computed in
    # this chunk too; `verify` asks for the logits of every proposed position (the target's check).
    draft: Sequence[int] = ()
    verify: bool = False
    draft_probs: object | None = None  # [len(draft), V] tensor: the draft model's distributions

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so the next token is sampled
        (a request asking for 0 new tokens only scores its prompt)."""
        return (self.start + self.length == self.req.total_len + len(self.draft)
                and self.req.params.max_new_tokens > 0)

    @property
    def logit_rows(self) -> int:
        """Rows of logits a sampling chunk returns: one, or one per proposed token plus one."""
        return len(self.draft) + 1 if self.verify else 1

    @property
    def prompt_rows(self) -> range:
        """Positions of this chunk whose logits give a prompt log-prob still to compute (the
        logits at position p score prompt token p + 1)."""
        req = self.req
        if req.logprob_start_len < 0:
            return range(0)
        return range(max(self.start, req.prompt_lp_next - 1),
                     min(self.start + self.length, len(req.prompt_ids) - 1))


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        cache: RadixCache | None,
        block_size: int,
        chunked_prefill_size: int,
        max_running_requests: int,
        copy_kv: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """copy_kv(src_block, dst_block, n) copies the first n KV entries of a block into another
        (every layer); without it only whole cached blocks are reused."""
        self.pool = pool
        self.cache = cache
        self.block_size = block_size
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running = max_running_requests
        self.copy_kv = copy_kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> list[Chunk]:
        chunks = self._schedule_once()
        while not chunks and self.running:
            # Every running request is mid-prefill and the pool is full: free the newest one's
            # blocks so the others can finish (it is recomputed later).
            self._preempt(max(self.running, key=_age))
            chunks = self._schedule_once()
        return chunks

    def _schedule_once(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        # Oldest first: preemption only takes strictly newer requests, which have no chunk yet.
        for req in sorted(self.running, key=_age):
            if req.state is ReqState.RUNNING and req.tokens_to_compute == 1:
                if self._grow(req, req.total_len, may_preempt=True):
                    chunks.append(Chunk(req, req.num_computed, 1))

        budget = self.chunked_prefill_size - len(chunks)
        computing: set[tuple[int, tuple[int, ...]]] = set()  # blocks this step's prefills fill
        for req in list(self.running):
            if budget <= 0:
                break
            if req.state is ReqState.RUNNING and req.tokens_to_compute > 1:
                n = _prefill_len(req, budget, self.chunked_prefill_size)
                # No preemption here: a victim may already hold a decode chunk of this step.
                if n and self._grow(req, req.num_computed + n, may_preempt=False):
                    chunks.append(Chunk(req, req.num_computed, n))
                    computing.add(self._first_block(req, n))
                    budget -= n

        deferred: list[Request] = []
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            self._attach_prefix(req)
            first = self._first_block(req, req.tokens_to_compute)
            if first is not None and first in computing:
                # Another request computes this very block in this step (the samples of one
                # prompt arrive together): wait one step and reuse it from the cache instead,
                # and let the requests behind it in.
                self._release(req)
                deferred.append(self.waiting.popleft())
                if len(deferred) < _MAX_DEFERRED:
                    continue
                break
            n = _prefill_len(req, budget, self.chunked_prefill_size)
            if n == 0 or not self._grow(req, req.num_computed + n, may_preempt=False):
                self._release(req)
                break
            self.waiting.popleft()
            if not req.admitted_once:  # set here, not in _attach_prefix: an attempt may fail
                req.cached_tokens = req.num_computed
                req.admitted_once = True
            req.state = ReqState.RUNNING
            self.running.append(req)
            chunks.append(Chunk(req, req.num_computed, n))
            computing.add(self._first_block(req, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back in front, in their order
        return chunks

    def _first_block(self, req: Request, n: int) -> tuple[int, tuple[int, ...]] | None:
        """(position, tokens) of the whole block that computing n tokens of req from its
        num_computed fills first, when that is where a block starts; else None. With the cache
        on, a filled prompt block is shared from the next step on."""
        start, bs = req.num_computed, self.block_size
        if self.cache is None or start % bs or n < bs or start + bs > len(req.prompt_ids):
            return None
        return start, tuple(req.prompt_ids[start : start + bs])

    def after_forward(self, chunks: list[Chunk]) -> None:
        """Account the KV written by the step; cache full prompt blocks for requests to share."""
        for c in chunks:
            # Proposed tokens count once accepted (speculative.py moves num_computed on).
            c.req.num_computed = c.start + c.length - len(c.draft)
            if self.cache is not None and c.length > 1 and c.req.cacheable and not c.draft:
                self.cache.insert(c.req.prompt_ids[: c.req.num_computed], c.req.blocks)

    def reserve(self, req: Request, n_tokens: int) -> bool:
        """Blocks for n_tokens positions of req from free blocks only: room for the tokens a
        speculative step proposes is worth neither a cached prefix nor a preemption (nor the
        walk over the cache that finding evictable blocks costs)."""
        need = -(-n_tokens // self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        got = self.pool.allocate(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def finish(self, req: Request) -> None:
        """Remove a request (finished or aborted) from the queues and release its KV."""
        if req.state is ReqState.FINISHED:
            return  # already removed (finish_many)
        if req.state is ReqState.RUNNING and req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.state = ReqState.FINISHED

    def finish_many(self, reqs: list[Request]) -> None:
        """`finish` for many requests at once: the queue is filtered in one pass (aborting a
        20,000-prompt batch must not cost 20,000 scans of the queue)."""
        gone = {id(r) for r in reqs}
        if any(r.state is ReqState.WAITING for r in reqs):
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for req in reqs:
            if req.state is ReqState.WAITING:
                self._release(req)
                req.state = ReqState.FINISHED
            else:
                self.finish(req)

    def retract_all(self) -> None:
        """Move every running request back to the front of the queue, KV dropped (recomputed later)."""
        for req in reversed(self.running):
            self._release(req)
            req.state = ReqState.WAITING
            self.waiting.appendleft(req)
        self.running.clear()

    def _attach_prefix(self, req: Request) -> None:
        if req.blocks or self.cache is None or not req.cacheable:
            return
        tokens = req.all_ids
        # At least one token must be computed to get logits for the next sample; prompt
        # log-probs still missing need the logits of every position from the one before them.
        limit = min(len(tokens) - 1, max(req.prompt_lp_next - 1, 0))
        found = self.cache.match_prefix(tokens, limit, partial=self.copy_kv is not None)
        self.pool.incref(found.blocks)
        req.blocks = list(found.blocks)
        req.num_computed = len(found.blocks) * self.block_size
        if found.partial_len:
            src = found.partial_block
            self.pool.incref([src])  # not evictable while a fresh block is found for the copy
            dst = self.pool.allocate(1)
            if dst is None and self.cache.evict(1):
                dst = self.pool.allocate(1)
            if dst is not None:
                # Issued now, before any step could reuse src: stream order makes it safe.
                self.copy_kv(src, dst[0], found.partial_len)
                req.blocks.append(dst[0])
                req.num_computed += found.partial_len
            self.pool.decref([src])

    def _grow(self, req: Request, n_tokens: int, may_preempt: bool) -> bool:
        """Make req's blocks cover n_tokens positions; evict cache, then preempt newer requests."""
        need = -(-n_tokens // self.block_size) - len(req.blocks)
        if need > 0 and not may_preempt and self.cache is not None:
            # Without preemption only free + evictable blocks can serve: if they are too few,
            # evicting would wipe cached prefixes for an allocation that fails anyway.
            # num_evictable walks the whole tree: ask only when the free blocks fall short.
            if need > self.pool.num_free and need > self.pool.num_free + self.cache.num_evictable():
                return False
        while need > 0:
            got = self.pool.allocate(need)
            if got is not None:
                req.blocks.extend(got)
                return True
            missing = need - self.pool.num_free
            if self.cache is not None and self.cache.evict(missing) > 0:
                continue
            if not may_preempt:
                return False
            victim = self._newest_running_after(req)
            if victim is None:  # nothing newer to take from: give up this request's place
                self._preempt(req)
                return False
            self._preempt(victim)
        return True

    def _newest_running_after(self, req: Request) -> Request | None:
        # Strictly newer under the decode loop's own order: with `>=` on arrival alone, a request
        # sharing its timestamp with one already given a chunk this step could preempt it.
        newer = [r for r in self.running if _age(r) > _age(req)]
        return max(newer, key=_age) if newer else None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.state = ReqState.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        if self.cache is not None and req.num_computed > 0 and req.cacheable:
            # The request lets go of its blocks: its partly filled last one is final, and kept.
            self.cache.insert(req.all_ids[: req.num_computed], req.blocks,
                              keep_partial=self.copy_kv is not None)
        self.pool.decref(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.draft_computed = 0


def _prefill_len(req: Request, budget: int, full_budget: int) -> int:
    """Tokens of req to prefill in this step's budget; 0 (wait for a step with more room) for a
    1-token chunk that would stop at a prompt position whose logits are needed: a step of
    1-token chunks may replay a CUDA graph, which returns only the logits of chunks that sample."""
    n = min(req.tokens_to_compute, budget)
    start = req.num_computed
    if (n == 1 < req.tokens_to_compute and budget < full_budget and req.logprob_start_len >= 0
            and req.prompt_lp_next - 1 <= start < len(req.prompt_ids) - 1):
        return 0
    return n


def _age(req: Request) -> tuple[float, str]:
    """Arrival order, made total by rid (live rids are unique) for requests submitted together."""
    return (req.arrival, req.rid)
