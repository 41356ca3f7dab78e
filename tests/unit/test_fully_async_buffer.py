"""The fully-async buffer (report 2.2.2, tables 1 and 2), the prompt ledger and the buffer contract."""

from __future__ import annotations

import threading
import time

import pytest

from milepost.data.accounting import PromptLedger
from milepost.data.buffer import (
    BufferClosed,
    BufferSettings,
    GroupBuffer,
    check_buffer_class,
    staleness,
)
from milepost.data.filters import rewards_differ
from milepost.data.source import PromptDataset, PromptItem
from milepost.types import Group, Sample, Status


def group(index: int, versions: list[list[str]], rewards: list[float] | None = None,
          aborted: bool = False) -> Group:
    rewards = rewards or [float(k) for k in range(len(versions))]
    return [Sample(group_index=index, index=k, tokens=[1] * (1 + len(v)), response_length=len(v),
                   weight_versions=v, reward=r,
                   status=Status.ABORTED if aborted and k == 0 else Status.COMPLETED)
            for k, (v, r) in enumerate(zip(versions, rewards))]


class Sink:
    def __init__(self) -> None:
        self.drops: list[tuple[int, str, bool]] = []

    def __call__(self, g: Group, reason: str, retry: bool) -> None:
        self.drops.append((g[0].group_index, reason, retry))


def test_staleness_is_measured_from_the_oldest_token_of_the_group() -> None:
    g = group(0, [["3", "4", "4"], ["2", "4"]])  # one token of version 2 makes it 2 behind at 4
    assert staleness(g, 4) == 2
    assert staleness(group(0, [["4"], ["4"]]), 4) == 0
    with pytest.raises(ValueError, match="not integers"):
        staleness(group(0, [["default"]]), 1)


def test_take_drops_groups_past_the_limit_and_retries_or_discards_them() -> None:
    for policy in ("retry", "discard"):
        sink = Sink()
        buf = GroupBuffer(BufferSettings(capacity=4, max_staleness=1, stale_policy=policy), sink)
        buf.put(group(0, [["1"], ["3"]]))  # staleness 2 at version 3: dropped on the way out
        buf.put(group(1, [["2"], ["3"]]))
        buf.put(group(2, [["3"], ["3"]]))
        taken = buf.take(2, trainer_version=3)
        assert [g[0].group_index for g in taken] == [1, 2]
        assert sink.drops == [(0, "stale", policy == "retry")]
        m = buf.metrics(3)
        assert m["queue_size"] == 3 and m["stale_groups_filtered"] == 1
        assert m["avg_staleness"] == 0.5 and m["max_staleness"] == 1
        assert buf.metrics(3)["stale_groups_filtered"] == 0  # counts are per step


def test_arrival_drops_aborted_and_filtered_groups() -> None:
    sink = Sink()
    buf = GroupBuffer(BufferSettings(capacity=4, aborted_policy="retry", group_filter=rewards_differ),
                      sink)
    buf.put(group(0, [["0"], ["0"]], aborted=True))
    buf.put(group(1, [["0"], ["0"]], rewards=[1.0, 1.0]))  # no signal: discarded, never retried
    buf.put(group(2, [["0"], ["0"]], rewards=[0.0, 1.0]))
    assert len(buf) == 1
    assert sink.drops == [(0, "aborted", True), (1, "filtered", False)]
    m = buf.metrics(0)
    assert m["aborted_groups_filtered"] == 1 and m["filter_groups_filtered"] == 1


def test_put_blocks_while_full_and_waiting_groups_report_their_staleness() -> None:
    buf = GroupBuffer(BufferSettings(capacity=2), Sink())
    buf.put(group(0, [["0"]]))
    buf.put(group(1, [["1"]]))
    done = threading.Event()
    t = threading.Thread(target=lambda: (buf.put(group(2, [["2"]])), done.set()), daemon=True)
    t.start()
    time.sleep(0.2)
    assert not done.is_set() and len(buf) == 2  # blocked: the buffer is full
    m = buf.metrics(2)
    assert m["buffer_max_staleness"] == 2 and m["buffer_avg_staleness"] == 1.5
    assert [g[0].group_index for g in buf.take(1, 2)] == [0]
    assert done.wait(60) and len(buf) == 2  # woken at once; 60: a loaded machine may be slow


def test_close_wakes_a_waiting_take() -> None:
    buf = GroupBuffer(BufferSettings(capacity=2), Sink())
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(lambda: buf.take(1, 0), errors), daemon=True)
    t.start()
    time.sleep(0.1)  # usually inside take() by now; a take after close raises the same
    buf.close()
    t.join(60)  # ends at once; 60: a loaded machine may not schedule the thread for a while
    assert isinstance(errors[0], BufferClosed)


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        errors.append(e)


def test_settings_refuse_a_negative_staleness_limit() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        BufferSettings(capacity=2, max_staleness=-1)


def test_ledger_requeues_retried_prompts_and_saves_outstanding_ones_first() -> None:
    items = [PromptItem(i, f"p{i}", [i + 1]) for i in range(5)]
    ledger = PromptLedger(PromptDataset(items, shuffle=False))
    drawn = [ledger.draw() for _ in range(3)]
    assert [g for g, _ in drawn] == [0, 1, 2]
    ledger.drop(group(0, [["0"]]), "aborted", retry=True)
    ledger.trained_groups([group(1, [["0"]])])
    assert ledger.summary()["prompts_outstanding"] == 1
    assert ledger.data_state()["retry"] == [2, 0]  # still generating first, then the retry
    assert ledger.draw()[1].index == 0  # the retried prompt is served before new ones
    s = ledger.summary()
    assert s["prompts_drawn"] == 4 and s["prompts_trained"] == 1 and s["prompts_dropped_aborted"] == 1


# ---- the contract of a user's buffer class --------------------------------------------------

class LifoBuffer(GroupBuffer):
    """A user's selector: newest group first. Only `take` changes; the rest is inherited."""

    def take(self, batch_size: int, trainer_version: int) -> list[Group]:
        out = super().take(batch_size, trainer_version)
        return out[::-1]


class NoMetrics:
    def __init__(self, settings, drop) -> None:
        self.groups = []

    def put(self, g):
        self.groups.append(g)

    def take(self, n, v):
        return self.groups[:n]

    def metrics(self, v):
        return {"queue_size": 0.0}

    def close(self):
        pass

    def __len__(self):
        return len(self.groups)


class NeverReturns(NoMetrics):
    def take(self, n, v):
        threading.Event().wait()


class LosesGroups(NoMetrics):
    def take(self, n, v):
        return []


def test_a_conforming_buffer_class_passes_the_contract() -> None:
    check_buffer_class(GroupBuffer, "GroupBuffer")
    check_buffer_class(LifoBuffer, "LifoBuffer")


@pytest.mark.parametrize("cls, why", [
    (NoMetrics, "metrics\\(\\) must return"),
    (NeverReturns, "put 2 groups into capacity 2, then take\\(2\\) did not return within"),
    (LosesGroups, "take\\(2\\) did not return the 2 fresh groups"),
    (object, "it has no put, take, metrics, close"),
])
def test_a_buffer_class_violating_the_contract_is_refused(cls: type, why: str) -> None:
    with pytest.raises(ValueError, match=f"violates the buffer contract: {why}"):
        check_buffer_class(cls, cls.__name__, timeout_s=0.5)
