"""End-to-end runs of `milepost train --fully-async` on CPU (issue 5): real launcher, a real engine
process and trainer ranks, disaggregated. Helpers (tiny model, recipes, subprocess runs) are the
sync loop's e2e helpers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_train_loop import Run, ok, train, work  # noqa: F401 - `work` is a fixture used here

ASYNC_METRICS = ("queue_size", "avg_staleness", "max_staleness", "buffer_avg_staleness",
                 "buffer_max_staleness", "aborted_groups_filtered", "stale_groups_filtered",
                 "engine_idle_time", "inflight_mean")
BUFFERS = '''
"""Buffer plug-ins of the e2e runs."""
from milepost.data.buffer import GroupBuffer


class NewestFirst(GroupBuffer):
    def take(self, batch_size, trainer_version):
        return super().take(batch_size, trainer_version)[::-1]


class Forgetful(GroupBuffer):
    def take(self, batch_size, trainer_version):
        return []


class WeightNorm:
    """An external evaluation backend: reads only the snapshot directory it is given."""

    def evaluate(self, checkpoint_dir, prompt_data, step):
        import time
        from safetensors.torch import load_file

        weights = load_file(str(checkpoint_dir / "model.safetensors"))
        if step == 0:  # a slow first evaluation: returns once training logged 3 more steps
            metrics = checkpoint_dir.parent.parent / "metrics.jsonl"
            # Not a fixed time: 3 steps took 6 s idle and minutes at load 8 on 2 cores; the run's
            # own limit (RUN_TIMEOUT_S) ends it if training stops.
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and (
                    not metrics.exists() or len(metrics.read_text().splitlines()) < 4):
                time.sleep(0.05)
        norm = sum(float(t.float().pow(2).sum()) for t in weights.values()) ** 0.5
        return {"weight_norm": norm, "num_prompts": float(len(open(prompt_data).readlines()))}


class Broken:
    def evaluate(self, checkpoint_dir, prompt_data, step):
        raise RuntimeError("the evaluation service is down")
'''


@pytest.fixture(scope="module")
def plugins(work: Path) -> Path:  # noqa: F811
    (work / "rewards" / "e2e_buffers.py").write_text(BUFFERS)
    return work


def accounting(run: Run) -> dict[str, float]:
    return json.loads((run.run_dir / "fully_async_accounting.json").read_text())


def check_accounts(run: Run) -> dict[str, float]:
    """Every drawn prompt: trained, dropped (by reason), waiting in the buffer, or generating."""
    a = accounting(run)
    dropped = sum(v for k, v in a.items() if k.startswith("prompts_dropped_"))
    assert a["prompts_drawn"] == a["prompts_trained"] + dropped + a["in_buffer"] + a["generating"], a
    assert a["prompts_outstanding"] == a["in_buffer"] + a["generating"], a
    return a


def test_two_ranks_fully_async_trains_every_step_and_accounts_for_every_prompt(plugins):
    run = ok(train(plugins, plugins / "async", "--fully-async", actor_num_gpus_per_node=2,
                   num_rollout=5, buffer_class="e2e_buffers:NewestFirst"))
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(5))
    for r in records:
        missing = [k for k in ASYNC_METRICS if not math.isfinite(r.get(f"rollout/fully_async/{k}",
                                                                        math.nan))]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert math.isfinite(r["perf/trainer_wait_time"]) and math.isfinite(r["train/grad_norm"])
        assert r["rollout/num_groups"] == 2
    # Generation overlapped training: later steps trained groups generated under older weights.
    assert max(r["rollout/fully_async/max_staleness"] for r in records) >= 1
    a = check_accounts(run)
    assert a["prompts_trained"] == 5 * 2
    assert (run.run_dir / "checkpoints").is_dir()


def test_staleness_zero_abort_retry_on_policy_and_a_broken_external_evaluation(plugins):
    # One run for three claims (a run costs ~12 CPU-seconds): groups past the staleness limit and
    # groups aborted at an update (abort mode, group granularity) are both retried; and an
    # external evaluation backend that raises is recorded per due step while training goes on
    # (its thread only reads snapshots, so the on-policy claims are the same with or without it).
    run = ok(train(plugins, plugins / "onpolicy-abort", "--fully-async", max_staleness=0,
                   stale_group_policy="retry", pause_generation_mode="abort",
                   rollout_granularity="group", aborted_group_policy="retry",
                   rollout_max_response_len=24, eval_interval=2, eval_mode="external",
                   eval_backend="e2e_buffers:Broken", eval_prompt_data=str(plugins / "prompts.jsonl")))
    records = run.metrics()
    assert len(records) == 4
    assert all(r["rollout/fully_async/max_staleness"] == 0 for r in records)
    a = check_accounts(run)
    assert a["prompts_trained"] == 4 * 2
    evals = eval_records(run)
    assert [r["step"] for r in evals] == [1, 3]
    assert all("backend error: RuntimeError: the evaluation service is down"
               in r["skipped_reason"] for r in evals)


def test_evaluation_on_shared_engines_scores_the_version_of_its_step(plugins):
    # Generation of new groups holds while the evaluation runs; trajectories in flight go on
    # under the same weights, so every eval request is served by exactly the step's version.
    run = ok(train(plugins, plugins / "async-eval", "--fully-async", eval_interval=2,
                   eval_prompt_data=str(plugins / "prompts.jsonl")))
    evals = [r for r in run.metrics() if "eval/skipped" in r]
    assert [r["step"] for r in evals] == [1, 3]
    for r in evals:
        assert r["eval/skipped"] == 0 and r["eval/mixed_version_frac"] == 0, r
        assert r["eval/weight_version"] == r["step"] + 1 and math.isfinite(r["eval/reward_mean"])


def test_resume_generates_again_the_prompts_outstanding_at_the_checkpoint(plugins):
    from milepost.train.checkpoint import META_FILE

    run_dir = plugins / "async-resume"
    ok(train(plugins, run_dir, "--fully-async", num_rollout=3))
    meta = json.loads((run_dir / "checkpoints" / "step_00000002" / META_FILE).read_text())
    retry = meta["extra"]["data"]["retry"]
    assert retry, "prompts generating or waiting at the checkpoint must be first in line"
    resumed = ok(train(plugins, run_dir, "--fully-async", num_rollout=5))
    assert [r["step"] for r in resumed.metrics()] == list(range(5))
    a = check_accounts(resumed)
    assert a["prompts_trained"] == 2 * 2  # the resumed part: steps 3 and 4


def test_in_place_updates_reach_trajectories_mid_generation(plugins):
    # Long responses with few in flight make generation the slow side, so every update lands
    # while trajectories generate: some then hold tokens of two weight versions, and are trained.
    run = ok(train(plugins, plugins / "in-place", "--fully-async", pause_generation_mode="in_place",
                   rollout_max_response_len=96, num_rollout=5))
    records = run.metrics()
    assert len(records) == 5
    assert max(r["rollout/fully_async/mixed_version_frac"] for r in records) > 0
    check_accounts(run)


def eval_records(run: Run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "eval_async.jsonl").read_text().splitlines()]


def test_external_evaluation_runs_beside_training_and_records_late_scores(plugins):
    run = ok(train(plugins, plugins / "ext-eval", "--fully-async", num_rollout=6, eval_interval=1,
                   eval_mode="external", eval_backend="e2e_buffers:WeightNorm",
                   eval_prompt_data=str(plugins / "prompts.jsonl")))
    records = eval_records(run)
    assert sorted(r["step"] for r in records) == list(range(6))  # every due evaluation: a record
    done = [r for r in records if r["skipped_reason"] is None]
    skipped = [r for r in records if r["skipped_reason"] is not None]
    assert done and all(r["metrics"]["num_prompts"] == 8 for r in done)
    # Training did not wait: results came in steps later, and dues past the limit were skipped.
    assert any(r["delay_steps"] >= 1 for r in done), records
    assert skipped and all("too many evaluations outstanding" in r["skipped_reason"]
                           for r in skipped), records
    first = next(r for r in done if r["step"] == 0)
    assert first["delay_steps"] >= 3 and {1, 2} <= {r["step"] for r in skipped}
    assert len(done) >= 2, records
    # Each score measured its own step's weights: training changed them between snapshots.
    norms = {r["step"]: r["metrics"]["weight_norm"] for r in done}
    assert len(set(norms.values())) == len(norms)
    assert (run.run_dir / "eval_snapshots" / f"step_{done[0]['step']:08d}" / "config.json").is_file()


def test_dedicated_fleet_scores_verified_snapshots_beside_training(plugins):
    run = ok(train(plugins, plugins / "fleet-eval", "--fully-async", eval_interval=2,
                   eval_mode="dedicated", max_outstanding_evals=2,
                   eval_prompt_data=str(plugins / "prompts.jsonl")))
    records = eval_records(run)
    assert sorted(r["step"] for r in records) == [1, 3]
    for r in records:
        assert r["skipped_reason"] is None, r
        m = r["metrics"]
        # Every engine loaded the snapshot of that step, and the score proves it.
        assert m["weight_version"] == r["step"] + 1 and m["mixed_version_frac"] == 0, r
        assert m["num_samples"] == 8 and math.isfinite(m["reward_mean"])
    assert (run.run_dir / "logs" / "eval-engine-0.log").is_file()
    assert len(run.metrics()) == 4


@pytest.mark.parametrize("settings, message", [
    ({"colocate": True}, "refused with --colocate"),
    ({"max_staleness": -1}, "--max-staleness -1 is negative"),
    ({"buffer_capacity_factor": 0.5}, "smaller than one train batch"),
    ({"buffer_class": "e2e_buffers:Forgetful"}, "violates the buffer contract"),
])
def test_bad_fully_async_settings_are_refused_at_start(plugins, settings, message):
    run = train(plugins, plugins / f"bad-{len(message)}", "--fully-async", timeout=60, **settings)
    assert run.rc != 0 and message in run.out, run.out[-3000:]
    assert not (run.run_dir / "metrics.jsonl").exists()
