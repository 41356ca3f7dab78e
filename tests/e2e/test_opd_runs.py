"""`milepost train` with a served distillation teacher: real launcher, engine, teacher and ranks.

The teacher serves the student's own starting checkpoint, so the first step's reverse-KL estimate
is ~0 (the one-sample estimate; a top-K run too). Under --fully-async the rollout worker scores
the groups. A teacher that cannot be reached, or prompts whose tag has no teacher, stop the run at
start with a message naming them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_train_loop import train, work  # noqa: F401 - `work` is a fixture used here

from milepost.testing.server_process import ServerProcess


@pytest.fixture(scope="module")
def teacher(work: Path) -> Iterator[ServerProcess]:  # noqa: F811
    """One teacher engine for both served runs: it only scores, its weights never change, so a
    second engine start (~4 CPU-seconds) would prove nothing more (docs/testing.md)."""
    with ServerProcess(work / "qwen3", "--max-total-tokens", "8192") as srv:
        yield srv


@pytest.mark.xdist_group("opd_runs_teacher")  # both cases on the worker that holds the teacher
@pytest.mark.parametrize("args", [(), pytest.param(("--fully-async", "--opd-top-k", "2"),
                                                  marks=pytest.mark.slow)], ids=["sync", "async-topk"])
def test_served_teacher_runs_and_logs_opd_metrics(work, teacher, args) -> None:  # noqa: F811
    name = "opd-" + ("async" if args else "sync")
    run = train(work, work / name, "--opd-teacher-url", teacher.url, *args, num_rollout=3)
    assert run.rc == 0, run.out[-4000:]
    records = run.metrics()
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert "opd/reverse_kl_mean" in r and "opd/teacher_logprob_mean" in r
        if not args:  # sync: each step scores its own batch
            assert r["opd/scored_samples/teacher"] > 0 and r["opd/teacher_time"] > 0
    # fully async: the worker may score a later step's groups during an earlier step, so a step's
    # window can hold none (reported as 0, never missing); over the run every batch was scored
    assert all(r["opd/scored_samples/teacher"] >= 0 for r in records)
    assert sum(r["opd/scored_samples/teacher"] for r in records) > 0
    assert abs(records[0]["opd/reverse_kl_mean"]) < 1e-3  # teacher == the student before training


def test_unreachable_teacher_is_refused_at_start(work) -> None:  # noqa: F811
    run = train(work, work / "opd-gone", "--opd-teacher-url", "http://127.0.0.1:9", num_rollout=1)
    assert run.rc != 0
    assert "teacher http://127.0.0.1:9 cannot be used" in run.out


def test_prompts_without_a_teachers_tag_are_refused_at_start(work) -> None:  # noqa: F811
    run = train(work, work / "opd-tags", "--opd-teachers", '[{"url": "http://127.0.0.1:9", "tag": "math"}]',
                num_rollout=1)
    assert run.rc != 0
    assert "prompts carry metadata.teacher ['None']" in run.out


@pytest.mark.slow
def test_in_process_teacher_on_two_ranks(work) -> None:  # noqa: F811
    """Each rank scores its share with the sharded teacher; the shares are gathered, so the
    signal covers every sample (a missing one would stop the step)."""
    run = train(work, work / "opd-ranks", "--opd-teacher-checkpoint", str(work / "qwen3"),
                actor_num_gpus_per_node=2, num_rollout=2)
    assert run.rc == 0, run.out[-4000:]
    records = run.metrics()
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["opd/teacher_time"] > 0 for r in records)
    assert abs(records[0]["opd/reverse_kl_mean"]) < 1e-3  # teacher == the student before training
