"""Divergence of a replayed history (report 2.4.1, 2.4.2; issues 16 and 19.5): a linear session
never silently replaces its stored turns. Reject answers with the message index and field; rollback
keeps the longest replayed prefix and records what it dropped; an omitted reasoning the template
does not read is no divergence; the counts reach the samples and the rollout metrics."""

from __future__ import annotations

import pytest

from milepost.rollout.generate import RolloutResult, rollout_metrics
from milepost.session.matchers import difference, json_args, omit_reasoning, strict
from milepost.session.sequence import build_samples
from milepost.session.store import Session, SessionConflict

CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
U1 = {"role": "user", "content": "Weather in Oslo?"}
A1 = {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
      "tool_calls": [CALL]}
T1 = {"role": "tool", "tool_call_id": "c1", "content": "snow"}
A2 = {"role": "assistant", "content": "Snow.", "reasoning_content": "It said snow."}
U2 = {"role": "user", "content": "Thanks"}
A3 = {"role": "assistant", "content": "Welcome."}
U3 = {"role": "user", "content": "Bye"}
NO_REASONING = {k: v for k, v in A1.items() if k != "reasoning_content"}
RESERIALIZED = {**A1, "tool_calls": [{**CALL, "function": {**CALL["function"],
                                                           "arguments": '{"city":"Oslo"}'}}]}


def _turn(s: Session, at, messages, out, divergence=None):
    return s.add_turn(at, messages, None, divergence, prompt_ids=[1] * 3, output_ids=out,
                      logprobs=[-0.1] * len(out), weight_versions=["1"] * len(out),
                      weight_version="1", finish_reason={"type": "stop"})


def _three_turns(policy: str, matcher=strict) -> Session:
    s = Session("s", "linear", matcher, policy)
    t1 = _turn(s, s.root, [U1, A1], [10, 11, 12])
    t2 = _turn(s, t1, [U1, A1, T1, A2], [13, 14])
    _turn(s, t2, [U1, A1, T1, A2, U2, A3], [15])
    return s


def test_difference_names_the_field_and_the_matcher_that_accepts_it() -> None:
    assert difference(A1, NO_REASONING) == "reasoning_content (omitted by the request)"
    assert "the same JSON" in difference(A1, RESERIALIZED)
    assert difference(A1, {**A1, "content": "x"}) == "content"
    assert omit_reasoning(A1, {**RESERIALIZED, "reasoning_content": None})
    assert not omit_reasoning(A1, {**A1, "reasoning_content": "something else"})
    assert not json_args(A1, NO_REASONING)


def test_reject_names_message_field_and_matcher_and_keeps_the_history() -> None:
    s = _three_turns("reject")
    tail = s.tail
    with pytest.raises(SessionConflict) as e:
        s.attach([U1, NO_REASONING, T1, A2, U2, A3, U3], None)
    msg = str(e.value)
    assert "at message 1 (assistant)" in msg and "reasoning_content" in msg
    assert "--session-matcher omit_reasoning" in msg
    assert e.value.divergence.kind == "rejected"
    assert s.tail is tail and [d.kind for d in s.divergences] == ["rejected"]


def test_a_rewritten_assistant_turn_is_never_a_silent_retry() -> None:
    # Issue 19.5: the old code attached this at the root as "a retry of the first turn".
    s = Session("s", "linear", strict)
    _turn(s, s.root, [U1, A3], [10, 11])
    with pytest.raises(SessionConflict, match=r"at message 1 \(assistant\), in content"):
        s.attach([U1, {"role": "assistant", "content": "I never said this"}, U2], None)
    assert s.attach([U1], None).at is s.root  # a real retry (same prompt) still is one


def test_rollback_keeps_the_longest_replayed_prefix_and_records_it() -> None:
    s = _three_turns("rollback")
    t1, t2, t3 = s.tail.path()
    # The client re-sends turn 2's reply differently: turns 1 stays, turns 2 and 3 drop.
    a = s.attach([U1, A1, T1, {**A2, "content": "Snowy."}, U2, A3, U3], None)
    assert a.at is t1 and a.divergence.kind == "rollback"
    assert (a.divergence.message, a.divergence.dropped_turns) == (3, [t2.id, t3.id])
    assert a.divergence.retokenized_tokens == len(t2.output_ids) + len(t3.output_ids)
    assert s.divergences == []  # nothing is written before the turn completes
    t4 = _turn(s, a.at, [U1, A1, T1, {**A2, "content": "Snowy."}, U2, A3, U3, A3], [16],
               a.divergence)
    assert s.leaves() == [t4] and [t.id for t in t4.path()] == [t1.id, t4.id]
    (sample,) = build_samples(s)
    assert sample.metadata["session_rollbacks"] == 1
    assert sample.metadata["session_retokenized_tokens"] == 3
    assert sum(sample.loss_mask) == len(t1.output_ids) + len(t4.output_ids)
    sample.reward = 1.0
    metrics = rollout_metrics(RolloutResult(groups=[[sample, sample]], elapsed_s=1.0))
    assert metrics["session_rollbacks"] == 1.0  # one session, counted once
    assert metrics["session_retokenized_tokens"] == 3.0


def test_omitted_reasoning_matches_only_where_the_template_does_not_read_it() -> None:
    s = _three_turns("reject")
    replay = [U1, NO_REASONING, T1, {k: v for k, v in A2.items() if k != "reasoning_content"},
              U2, A3, U3]
    probed = []

    def unread(messages, i, reasoning):  # a Qwen3-like template: before the last user message
        probed.append(i)
        last_user = max(k for k, m in enumerate(messages) if m["role"] == "user")
        return i > last_user

    a = s.attach(replay, None, reads_reasoning=unread)
    assert a.at is s.tail and a.divergence is None and a.new_messages == [U3]
    assert set(probed) == {1, 3}
    with pytest.raises(SessionConflict, match="reasoning_content"):
        s.attach(replay, None, reads_reasoning=lambda m, i, r: True)  # a template that reads it


def test_branching_records_a_fork_at_a_rewritten_assistant_message() -> None:
    s = Session("s", "branching", strict)
    t1 = _turn(s, s.root, [U1, A1], [10, 11])
    _turn(s, t1, [U1, A1, T1, A2], [12])
    a = s.attach([U1, RESERIALIZED, T1], None)
    assert a.at is s.root and a.divergence.kind == "fork"
    assert a.divergence.suggestion == "json_args" and a.divergence.retokenized_tokens == 2
    assert Session("s", "branching", json_args).attach([U1, A1, U2], None).divergence is None


def test_divergence_setting_is_checked_at_start(tmp_path) -> None:
    import json

    from milepost.config import load_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "x"}\n')
    base = ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-rollout", "1",
            "--rollout-batch-size", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
            "--use-session-server", "--session-model-family", "qwen3"]
    assert load_config(None, base).session_divergence == "reject"
    assert load_config(None, base + ["--session-divergence", "rollback"]).session_divergence \
        == "rollback"
    for flags, needle in [(["--session-divergence", "undo"], "--session-divergence"),
                          (["--session-divergence", "rollback", "--session-mode", "branching"],
                           "no effect on a branching session")]:
        with pytest.raises(Exception, match=needle):
            load_config(None, base + flags)
