"""The rollout worker's replacement rule, observed from its own trajectory start/finish events
(issue 5, report 2.2.1): `sample` granularity returns a trajectory's place when it ends, `group`
granularity only when the last trajectory of its group ends.

The real worker drives a real engine over HTTP. The only thing added is a thin wrapper around
the `generate_one` the worker calls: it records when each trajectory starts and ends and gives
sample 0 of every group a long response (the others one token), so every group has a long tail.
With places for two groups, the two rules then lead to different schedules:
- sample: once the short trajectories of groups 0 and 1 end, their places start group 2 while
  both long trajectories still generate (more groups open than max_inflight / n);
- group: group 2 starts only after every trajectory of group 0 or 1 has ended.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from milepost.data.accounting import PromptLedger
from milepost.data.buffer import BufferSettings, GroupBuffer
from milepost.data.source import PromptDataset, PromptItem
from milepost.rollout import scheduler
from milepost.rollout.generate import SamplingSettings
from milepost.rollout.scheduler import RolloutWorker, WorkerSettings
from milepost.testing.rewards import token_parity_reward

N = 2  # samples per prompt
MAX_INFLIGHT = 2 * N  # places for two groups
LONG = 48  # tokens of each group's sample 0 (the others: 1)
GROUPS = 6  # finished groups to observe
WAIT_S = 300  # for them: seconds idle, far longer on a loaded machine (polled, not slept)


def record_trajectories(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Events ("start" | "end", group, sample) in the order the worker's loop saw them."""
    events: list[tuple[str, int, int]] = []
    real = scheduler.generate_one

    async def traced(client, item, sampling, index, *, group_index, **kw):
        length = LONG if index == 0 else 1
        item = dataclasses.replace(item, metadata={
            **item.metadata, "sampling_params": {"max_new_tokens": length, "ignore_eos": True}})
        events.append(("start", group_index, index))
        try:
            return await real(client, item, sampling, index, group_index=group_index, **kw)
        finally:
            events.append(("end", group_index, index))

    monkeypatch.setattr(scheduler, "generate_one", traced)
    return events


def run_worker(url: str, granularity: str, events: list) -> None:
    items = [PromptItem(i, f"p{i}", [5 + i, 7, 11]) for i in range(32)]
    ledger = PromptLedger(PromptDataset(items, shuffle=False))
    buffer = GroupBuffer(BufferSettings(capacity=32), lambda g, reason, retry: None)
    worker = RolloutWorker([url], ledger, buffer, SamplingSettings(max_new_tokens=LONG),
                           token_parity_reward, None,
                           WorkerSettings(N, MAX_INFLIGHT, granularity=granularity))
    worker.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(buffer) < GROUPS and worker.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()
    assert worker.error is None, worker.error
    assert len(buffer) >= GROUPS, f"only {len(buffer)} groups finished in {WAIT_S} s: {events}"


def open_groups_at_each_group_start(events: list) -> list[tuple[int, int, int]]:
    """(group, trajectories generating, groups not yet fully ended) when each group starts."""
    started: dict[int, int] = {}
    ended: dict[int, int] = {}
    seen: list[tuple[int, int, int]] = []
    for kind, g, _ in events:
        if kind == "start":
            if g not in started:
                generating = sum(started.values()) - sum(ended.values())
                unfinished = sum(1 for h in started if ended.get(h, 0) < N)
                seen.append((g, generating, unfinished))
            started[g] = started.get(g, 0) + 1
        else:
            ended[g] = ended.get(g, 0) + 1
    return seen


def test_sample_granularity_reuses_a_short_trajectorys_place_before_its_group_ends(
        qwen3_server, monkeypatch):
    events = record_trajectories(monkeypatch)
    run_worker(qwen3_server.url, "sample", events)
    seen = open_groups_at_each_group_start(events)
    # Never more trajectories in flight than max_inflight...
    assert all(generating + N <= MAX_INFLIGHT for _, generating, _ in seen), seen
    # ...but a group started while earlier groups still held places by group rule: only places
    # of ended trajectories (of unfinished groups) made room for it.
    assert any((unfinished + 1) * N > MAX_INFLIGHT for _, _, unfinished in seen), seen


def test_group_granularity_returns_places_only_when_a_group_ends(qwen3_server, monkeypatch):
    events = record_trajectories(monkeypatch)
    run_worker(qwen3_server.url, "group", events)
    seen = open_groups_at_each_group_start(events)
    assert len(seen) >= GROUPS
    # Every group started with its n places taken only from groups that had fully ended.
    assert all((unfinished + 1) * N <= MAX_INFLIGHT for _, _, unfinished in seen), seen
    # The short trajectories did end long before their groups (the test can tell the rules apart).
    first_long_end = next(i for i, e in enumerate(events) if e[0] == "end" and e[2] == 0)
    assert any(e[0] == "end" and e[2] != 0 for e in events[:first_long_end]), events
