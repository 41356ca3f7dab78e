"""Scheduler driven like the engine drives it, with fake requests and a fake forward pass.

The fake forward records which token each KV slot holds and checks that every chunk sees its
whole sequence in its blocks, so a block shared wrongly or freed too early shows up as a wrong
token. After every step the pool's reference counts must equal the references held by running
requests plus the prefix cache.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from milepost.engine.block_pool import BlockPool
from milepost.engine.radix_cache import RadixCache
from milepost.engine.request import ReqState, Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.scheduler import Chunk, Scheduler

BS = 4


def output_token(rid: str, i: int) -> int:
    """The fake model's i-th output of request rid (deterministic, so recompute is checkable)."""
    return 1000 + (sum(map(ord, rid)) * 7919 + i * 31) % 5000


class Sim:
    """The engine's step loop without a model: schedule -> forward -> after_forward -> sample."""

    def __init__(
        self, num_blocks: int, chunk: int = 16, max_running: int = 64, cache: bool = True,
        partial: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, BS) if cache else None
        self.sched = Scheduler(self.pool, self.cache, BS, chunk, max_running,
                               copy_kv=self._copy_kv if partial else None)
        self.kv: dict[int, int] = {}  # slot -> token whose KV was written there
        self.copies: list[tuple[int, int, int]] = []
        self.clock = 0
        self.reqs: list[Request] = []
        self.history: list[list[Chunk]] = []

    def add(
        self, prompt: list[int], max_new: int, rid: str | None = None, arrival: float | None = None
    ) -> Request:
        self.clock += 1
        req = Request(
            rid=rid or f"r{len(self.reqs)}", prompt_ids=list(prompt),
            params=SamplingParams(max_new_tokens=max_new), on_output=lambda _: None,
            stop_ids=frozenset(), arrival=float(self.clock if arrival is None else arrival),
        )
        self.reqs.append(req)
        self.sched.add(req)
        return req

    def step(self, stop: set[str] = frozenset()) -> list[Chunk]:
        """One step; requests whose rid is in `stop` finish on the token they sample."""
        decoding = [(r, r.num_computed) for r in self.sched.running if r.tokens_to_compute == 1]
        chunks = self.sched.schedule()
        scheduled = {id(c.req): c for c in chunks}
        for r, computed in decoding:
            # a decode is never starved: it runs, unless its request was preempted (and then
            # possibly re-admitted this same step, recomputing from an earlier position)
            if r.state is ReqState.RUNNING:
                c = scheduled.get(id(r))
                assert c is not None, f"{r.rid} skipped"
                assert (c.start, c.length) == (computed, 1) or c.start < computed
        self._forward(chunks)
        self.sched.after_forward(chunks)
        for c in chunks:
            if c.samples:
                req = c.req
                req.output_ids.append(output_token(req.rid, len(req.output_ids)))
                if len(req.output_ids) >= req.params.max_new_tokens or req.rid in stop:
                    self.sched.finish(req)
        check_invariants(self.sched)
        self.history.append(chunks)
        return chunks

    def run(self, max_steps: int = 1000) -> int:
        for n in range(max_steps):
            if not self.sched.has_work:
                return n
            self.step()
        raise AssertionError(f"still busy after {max_steps} steps: possible livelock")

    def _copy_kv(self, src: int, dst: int, n: int) -> None:
        assert 0 < n < BS, f"copy of {n} entries: whole blocks are shared, never copied"
        assert self.pool.refcount(src) >= 2 and self.pool.refcount(dst) == 1
        for i in range(n):
            self.kv[dst * BS + i] = self.kv[src * BS + i]
        self.copies.append((src, dst, n))

    def _forward(self, chunks: list[Chunk]) -> None:
        assert len({id(c.req) for c in chunks}) == len(chunks), "a request twice in one step"
        total = sum(c.length for c in chunks)
        assert total <= max(self.sched.chunked_prefill_size, len(chunks)), "token budget exceeded"
        for c in chunks:
            req = c.req
            assert req.state is ReqState.RUNNING and any(r is req for r in self.sched.running)
            assert c.length >= 1 and c.start == req.num_computed
            end = c.start + c.length
            assert end <= req.total_len
            assert len(req.blocks) * BS >= end, "chunk runs past the request's blocks"
            ids = req.all_ids
            for p in range(c.start, end):
                block = req.blocks[p // BS]
                assert self.pool.refcount(block) == 1, f"write into shared block {block}"
                self.kv[block * BS + p % BS] = ids[p]
            seen = [self.kv.get(req.blocks[p // BS] * BS + p % BS) for p in range(end)]
            assert seen == ids[:end], f"{req.rid} attends to wrong KV"


def check_invariants(sched: Scheduler) -> None:
    pool, cache = sched.pool, sched.cache
    refs: Counter[int] = Counter()
    for r in sched.running:
        assert r.state is ReqState.RUNNING
        assert len(set(r.blocks)) == len(r.blocks)
        assert r.num_computed <= len(r.blocks) * BS and r.num_computed <= r.total_len
        refs.update(r.blocks)
    for r in sched.waiting:
        assert r.state is ReqState.WAITING
        assert r.blocks == [] and r.num_computed == 0, "a waiting request holds KV"
    ids = [id(r) for r in [*sched.running, *sched.waiting]]
    assert len(ids) == len(set(ids)), "a request both running and waiting (or twice)"
    assert len(sched.running) <= sched.max_running
    if cache is not None:
        held = cache.held_blocks()
        assert len(held) == len(set(held)) == cache.num_cached_blocks
        refs.update(held)
    for b in range(pool.num_blocks):
        assert pool.refcount(b) == refs[b], f"block {b}: refcount {pool.refcount(b)} != {refs[b]}"
    assert pool.num_used == len(refs)


def check_drained(sim: Sim) -> None:
    """Nothing left but cache-held blocks; after a cache reset, everything free."""
    assert not sim.sched.has_work
    held = sim.cache.held_blocks() if sim.cache is not None else []
    assert sim.pool.num_used == len(held)
    assert all(sim.pool.refcount(b) == 1 for b in held)
    if sim.cache is not None:
        sim.cache.reset()
    assert sim.pool.num_free == sim.pool.num_blocks


def check_outputs(req: Request) -> None:
    """Finished with exactly the expected tokens: none lost or repeated by preemption."""
    assert req.state is ReqState.FINISHED
    n = req.params.max_new_tokens
    assert req.output_ids == [output_token(req.rid, i) for i in range(n)]


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 997 for i in range(n)]


# ---- continuous batching and chunked prefill ----------------------------------------------------


def test_request_added_while_others_decode_joins_the_next_step() -> None:
    sim = Sim(num_blocks=64)
    a, b = sim.add(prompt(1, 6), 20), sim.add(prompt(2, 5), 20)
    for _ in range(3):
        sim.step()
    assert len(a.output_ids) == 3 and len(b.output_ids) == 3
    c = sim.add(prompt(3, 7), 5)
    chunks = sim.step()
    by_req = {c_.req.rid: c_ for c_ in chunks}
    assert set(by_req) == {"r0", "r1", "r2"}
    assert by_req["r0"].length == 1 and by_req["r1"].length == 1
    assert by_req["r2"].start == 0 and by_req["r2"].length == 7
    assert len(c.output_ids) == 1, "the whole prompt went through: c sampled its first token"
    sim.run()
    for r in (a, b, c):
        check_outputs(r)
    check_drained(sim)


def test_chunked_prefill_respects_budget_and_never_starves_decodes() -> None:
    sim = Sim(num_blocks=64, chunk=8)
    d1, d2 = sim.add(prompt(1, 3), 30), sim.add(prompt(2, 4), 30)
    sim.step()  # both prefilled in one step (7 tokens)
    assert len(d1.output_ids) == 1 and len(d2.output_ids) == 1
    long = sim.add(prompt(3, 50), 3)
    steps = 0
    while not long.output_ids:
        chunks = sim.step()
        steps += 1
        lengths = {c.req.rid: c.length for c in chunks}
        assert lengths.get("r0") == 1 and lengths.get("r1") == 1, "decodes skipped this step"
        assert sum(lengths.values()) <= 8
        assert lengths["r2"] == min(6, 50 - 6 * (steps - 1))
    assert steps == -(-50 // 6)
    sim.run()
    for r in (d1, d2, long):
        check_outputs(r)
    check_drained(sim)


def test_decodes_filling_the_budget_hold_back_admissions() -> None:
    sim = Sim(num_blocks=64, chunk=4)
    reqs = [sim.add(prompt(i, 2), 6) for i in range(6)]
    for _ in range(4):
        sim.step()
    # four decoders use the whole budget of 4: the rest wait, and every step is all decodes
    assert len(sim.sched.running) == 4 and len(sim.sched.waiting) == 2
    chunks = sim.step()
    assert len(chunks) == 4 and all(c.length == 1 for c in chunks)
    sim.run()  # Sim.step checks every decoder decodes every step
    for r in reqs:
        check_outputs(r)


def test_max_running_requests_is_respected() -> None:
    sim = Sim(num_blocks=64, max_running=2)
    reqs = [sim.add(prompt(i, 5), 4) for i in range(5)]
    peak = 0
    while sim.sched.has_work:
        sim.step()
        peak = max(peak, len(sim.sched.running))
        assert len(sim.sched.running) <= 2
    assert peak == 2
    for r in reqs:
        check_outputs(r)
    check_drained(sim)


# ---- prefix reuse -------------------------------------------------------------------------------


def test_prompt_extending_a_finished_sequence_reuses_its_blocks() -> None:
    sim = Sim(num_blocks=64, chunk=64)
    first = sim.add(prompt(1, 21), 4)
    sim.run()
    second = sim.add(first.prompt_ids + [5, 6, 7, 8, 9, 10, 11], 3)
    chunks = sim.step()
    (c,) = chunks
    assert second.cached_tokens >= len(first.prompt_ids) - BS
    assert second.cached_tokens % BS == 0
    assert c.start == second.cached_tokens and c.length == len(second.prompt_ids) - c.start
    sim.run()
    check_outputs(second)
    assert second.cached_tokens == 20, "cached_tokens is kept from the first admission"


def test_prompt_extending_generated_tokens_reuses_them_too() -> None:
    sim = Sim(num_blocks=64, chunk=64)
    first = sim.add(prompt(1, 6), 10)
    sim.run()
    # a multi-turn follow-up: previous prompt + completion + new user turn
    second = sim.add(first.prompt_ids + first.output_ids + [1, 2, 3], 2)
    sim.step()
    # the last sampled token of `first` never went through the model: 15 tokens of KV -> 3 blocks
    assert second.cached_tokens == 12


@pytest.mark.parametrize("n_prompt", [16, 17])
def test_full_prompt_hit_still_computes_a_token(n_prompt: int) -> None:
    sim = Sim(num_blocks=64, chunk=64)
    first = sim.add(prompt(1, 24), 2)
    sim.run()
    second = sim.add(first.prompt_ids[:n_prompt], 2)
    (c,) = sim.step()
    assert c.length >= 1 and len(second.output_ids) == 1
    assert c.start == (12 if n_prompt == 16 else 16)
    assert second.cached_tokens == c.start
    sim.run()
    check_outputs(second)
    check_drained(sim)


def test_concurrent_identical_prompts_share_after_the_first_chunk() -> None:
    sim = Sim(num_blocks=64, chunk=8)
    a = sim.add(prompt(1, 20), 3)
    sim.step()  # a's first 8 tokens are cached
    b = sim.add(prompt(1, 20), 3)
    sim.step()  # a's second chunk uses the whole budget; b waits
    assert b.state is ReqState.WAITING
    sim.run()
    assert b.cached_tokens == 16, "a's first two chunks were cached before b was admitted"
    check_outputs(a)
    check_outputs(b)
    check_drained(sim)


def test_cached_tokens_reports_the_admission_that_happened() -> None:
    sim = Sim(num_blocks=10, chunk=64)
    first = sim.add(prompt(1, 8), 1)
    sim.run()  # the cache holds first's 2 blocks
    big = sim.add(prompt(2, 28), 2)  # 7 blocks, then 8 when it decodes
    sim.step()
    follow = sim.add(first.prompt_ids + prompt(3, 20), 1)  # matches 2 blocks, needs 5 more
    sim.step()
    assert follow.state is ReqState.WAITING, "no room yet"
    sim.cache.reset()  # e.g. a weight update drops the cached prefix before follow gets in
    sim.run()
    assert follow.cached_tokens == 0, "nothing was reused when it was actually admitted"
    check_outputs(big)
    check_outputs(follow)


def test_admission_that_cannot_fit_does_not_wipe_the_cache() -> None:
    sim = Sim(num_blocks=12, chunk=64)
    first = sim.add(prompt(1, 8), 1)
    sim.run()  # 2 evictable cached blocks
    running = sim.add(prompt(2, 24), 6)  # 6 blocks, growing to 8
    sim.step()
    waiting = sim.add(prompt(3, 30), 1)  # 8 blocks: 4 free + 2 evictable is not enough
    sim.step()
    assert waiting.state is ReqState.WAITING
    assert sim.cache.match(first.prompt_ids) != [], "evicted for an admission that failed anyway"
    sim.run()
    check_outputs(running)
    check_outputs(waiting)
    check_drained(sim)


def test_no_cache_means_no_reuse() -> None:
    sim = Sim(num_blocks=64, cache=False)
    first = sim.add(prompt(1, 12), 2)
    sim.run()
    second = sim.add(first.prompt_ids + [1], 2)
    (c,) = sim.step()
    assert c.start == 0 and second.cached_tokens == 0
    sim.run()
    check_drained(sim)


# ---- running out of blocks ----------------------------------------------------------------------


@pytest.mark.parametrize("cache", [True, False])
def test_preemption_takes_the_newest_and_keeps_its_tokens(cache: bool) -> None:
    # each request needs up to ceil((8 + 12) / 4) = 5 blocks; three of them want 15 of 10
    sim = Sim(num_blocks=10, chunk=64, cache=cache)
    reqs = [sim.add(prompt(i, 8), 12) for i in range(3)]
    preempted: list[Request] = []
    while sim.sched.has_work:
        before = {id(r): (r, list(r.output_ids)) for r in sim.sched.running}
        sim.step()
        gone = [r for r, _ in before.values()
                if r.state is ReqState.WAITING and all(x is not r for x in sim.sched.running)]
        stayed = [r for r, _ in before.values() if any(x is r for x in sim.sched.running)]
        for r in gone:
            assert all(r.arrival > s.arrival for s in stayed), "an older request was preempted"
            assert r.output_ids == before[id(r)][1], "preemption lost generated tokens"
            assert r.blocks == [] and any(w is r for w in sim.sched.waiting)
        preempted += gone
        assert len(sim.history) < 500
    assert sim.sched.num_preemptions > 0 and preempted
    assert all(r is reqs[2] or r is reqs[1] for r in preempted)
    for r in reqs:
        check_outputs(r)
    check_drained(sim)


def test_preempted_request_is_recomputed_from_its_tokens() -> None:
    sim = Sim(num_blocks=10, chunk=64)
    reqs = [sim.add(prompt(i, 8), 12) for i in range(3)]
    recomputed = False
    while sim.sched.has_work:
        chunks = sim.step()
        for c in chunks:
            # a prefill chunk over generated tokens: the preempted request recomputing its KV
            if c.length > 1 and c.start + c.length > len(c.req.prompt_ids):
                recomputed = True
    assert recomputed
    for r in reqs:
        check_outputs(r)


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("chunk", [3, 8, 64])
def test_pool_for_exactly_one_request_serves_many_in_turn(cache: bool, chunk: int) -> None:
    n_prompt, max_new = 10, 6
    sim = Sim(num_blocks=-(-(n_prompt + max_new) // BS), chunk=chunk, cache=cache)
    reqs = [sim.add(prompt(i, n_prompt), max_new) for i in range(6)]
    sim.run(max_steps=600)
    for r in reqs:
        check_outputs(r)
    check_drained(sim)


@pytest.mark.parametrize(("num_blocks", "max_new", "n"), [(5, 10, 3), (8, 12, 4), (6, 10, 3)])
def test_equal_arrival_times_never_preempt_a_scheduled_request(
    num_blocks: int, max_new: int, n: int
) -> None:
    # requests submitted together can share a timestamp; a tie must not let the later one in the
    # decode order preempt one that already holds a chunk of this step
    sim = Sim(num_blocks=num_blocks, chunk=64)
    reqs = [sim.add(prompt(i, 4), max_new, arrival=1.0) for i in range(n)]
    sim.run(max_steps=300)
    assert sim.sched.num_preemptions > 0
    for r in reqs:
        check_outputs(r)
    check_drained(sim)


def test_retract_all_requeues_running_requests_in_front_without_kv() -> None:
    sim = Sim(num_blocks=64, chunk=64, max_running=2)
    a, b, c = (sim.add(prompt(i, 9), 8) for i in range(3))
    for _ in range(3):
        sim.step()
    assert [r.rid for r in sim.sched.running] == ["r0", "r1"]
    outputs = {r.rid: list(r.output_ids) for r in (a, b)}
    sim.sched.retract_all()
    check_invariants(sim.sched)
    assert sim.sched.running == []
    assert [r.rid for r in sim.sched.waiting] == ["r0", "r1", "r2"]
    for r in (a, b):
        assert r.state is ReqState.WAITING and r.blocks == [] and r.num_computed == 0
        assert r.output_ids == outputs[r.rid]
    # only the cache holds KV now
    assert sim.pool.num_used == sim.cache.num_cached_blocks
    sim.run()
    for r in (a, b, c):
        check_outputs(r)
    check_drained(sim)


def test_finish_of_waiting_and_running_requests() -> None:
    sim = Sim(num_blocks=64, max_running=1)
    a, b = sim.add(prompt(1, 9), 8), sim.add(prompt(2, 9), 8)
    sim.step()
    sim.sched.finish(b)  # abort while waiting
    sim.sched.finish(a)  # abort mid-decode
    check_invariants(sim.sched)
    assert a.is_finished and b.is_finished and not sim.sched.has_work
    check_drained(sim)


def test_cache_reset_while_running_keeps_requests_correct() -> None:
    sim = Sim(num_blocks=64, chunk=8)
    a = sim.add(prompt(1, 20), 6)
    sim.step()
    sim.cache.reset()  # a weight update with flush_cache while a is mid-prefill
    check_invariants(sim.sched)
    b = sim.add(prompt(1, 20), 6)
    sim.run()
    check_outputs(a)
    check_outputs(b)
    check_drained(sim)


# ---- partial-block reuse (copy of a cached block's leading entries) ------------------------------


def test_next_turn_reuses_every_computed_token_through_a_copy() -> None:
    sim = Sim(num_blocks=64, chunk=64, partial=True)
    first = sim.add(prompt(1, 6), 10)
    sim.run()
    # 15 tokens went through the model (the last sample never does): 3 full blocks + 3 entries
    second = sim.add(first.prompt_ids + first.output_ids + [1, 2, 3], 2)
    (c,) = sim.step()
    assert second.cached_tokens == 15 and c.start == 15, "whole blocks + the copied 3 entries"
    assert [n for _, _, n in sim.copies] == [3]
    sim.run()
    check_outputs(second)
    check_drained(sim)


@pytest.mark.parametrize("n_prompt", [16, 17, 14])
def test_full_prompt_hit_copies_all_but_the_last_token(n_prompt: int) -> None:
    sim = Sim(num_blocks=64, chunk=64, partial=True)
    first = sim.add(prompt(1, 24), 2)
    sim.run()
    second = sim.add(first.prompt_ids[:n_prompt], 2)
    (c,) = sim.step()
    assert c.start == second.cached_tokens == n_prompt - 1 and c.length == 1
    sim.run()
    check_outputs(second)
    check_drained(sim)


def test_prompt_diverging_inside_a_cached_block_copies_up_to_the_divergence() -> None:
    sim = Sim(num_blocks=64, chunk=64, partial=True)
    first = sim.add(prompt(1, 20), 2)
    sim.run()
    second = sim.add(first.prompt_ids[:10] + [7, 7, 7, 7], 2)  # differs from token 10 on
    sim.step()
    assert second.cached_tokens == 10 and sim.copies[-1][2] == 2
    sim.run()
    check_outputs(second)


def test_superseded_partial_blocks_leave_the_cache() -> None:
    sim = Sim(num_blocks=64, chunk=64, partial=True)
    ids = prompt(1, 5)
    for turn in range(4):  # a session: each turn extends the previous context
        req = sim.add(ids, 6)
        sim.run()
        assert req.cached_tokens == (0 if turn == 0 else len(ids) - 4)
        ids = ids + req.output_ids + [900 + turn, 901 + turn, 902 + turn]
        held = sim.cache.held_blocks()
        # every full block of the context + one partial leaf; earlier partial leaves are gone
        assert len(held) == (len(req.all_ids) - 1) // BS + ((len(req.all_ids) - 1) % BS > 0)
    check_drained(sim)


# ---- randomized ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_random_workload_keeps_invariants_and_finishes(seed: int) -> None:
    rng = random.Random(seed)
    max_prompt, max_new = 30, 20
    num_blocks = -(-(max_prompt + max_new) // BS) + rng.randint(0, 8)  # fits the largest one
    sim = Sim(
        num_blocks=num_blocks, chunk=rng.choice([4, 8, 16, 64]),
        max_running=rng.choice([2, 4, 64]), cache=rng.random() < 0.8, partial=seed % 2 == 1,
    )
    bases = [prompt(100 + i, max_prompt) for i in range(3)]  # shared prefixes for the cache
    aborted: set[int] = set()
    stopped: set[int] = set()
    for step in range(200):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            n = rng.randint(1, max_prompt)
            base = rng.choice(bases)
            cut = rng.randint(0, n)
            p = base[:cut] + prompt(rng.randint(0, 10**6), n - cut)
            sim.add(p, rng.randint(1, max_new), arrival=step)  # a batch shares its timestamp
        stop = set()
        if sim.sched.running and rng.random() < 0.05:  # a stop token
            r = rng.choice(sim.sched.running)
            stop.add(r.rid)
        live = [*sim.sched.running, *sim.sched.waiting]
        sim.step(stop=stop)
        stopped |= {id(r) for r in live if r.rid in stop and r.is_finished}
        if live and rng.random() < 0.03:  # an abort between steps
            r = rng.choice(live)
            if not r.is_finished:
                sim.sched.finish(r)
                aborted.add(id(r))
                check_invariants(sim.sched)
        if rng.random() < 0.02:
            sim.sched.retract_all()
            check_invariants(sim.sched)
        if sim.cache is not None and rng.random() < 0.02:
            sim.cache.reset()
            check_invariants(sim.sched)
    sim.run(max_steps=2000)
    assert len(sim.reqs) > 50
    if sim.cache is not None and seed % 2 == 1:
        assert sim.copies, "partial-block reuse never ran"
    for r in sim.reqs:
        assert r.is_finished
        if id(r) not in aborted and id(r) not in stopped:
            check_outputs(r)
    check_drained(sim)


@pytest.mark.parametrize("partial", [False, True])
def test_samples_of_one_prompt_arriving_together_share_its_prefill(partial: bool) -> None:
    sim = Sim(num_blocks=64, chunk=64, partial=partial)
    group = [sim.add(prompt(1, 18), 3, arrival=0) for _ in range(4)]
    other = sim.add(prompt(2, 10), 3, arrival=0)
    chunks = sim.step()  # one sample computes the prompt; the unrelated request gets in too
    assert [(c.req, c.length) for c in chunks] == [(group[0], 18), (other, 10)]
    assert [r.rid for r in sim.sched.waiting] == [r.rid for r in group[1:]], "order kept"
    chunks = sim.step()  # the others reuse its blocks
    assert {c.req.rid for c in chunks} == {r.rid for r in [*group, other]}
    # whole blocks only: the first sample still writes its partly filled last block
    assert [r.cached_tokens for r in group[1:]] == [16] * 3
    assert other.cached_tokens == 0
    sim.run()
    for r in [*group, other]:
        check_outputs(r)
    check_drained(sim)
