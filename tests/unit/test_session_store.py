"""Session store (linear | branching), matchers, and the training-sequence builder, without an
engine: turns are stored as the service stores them."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from milepost.session.matchers import json_args, load_matcher, loose, strict
from milepost.session.sequence import build_sample, stitch_routed_experts
from milepost.session.store import Session, SessionConflict
from milepost.types import Status

CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}
REPLY = {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [CALL]}


def reserialized(msg: dict) -> dict:
    call = {**CALL, "function": {**CALL["function"], "arguments": '{"unit":"C","city":"Oslo"}'}}
    return {**msg, "tool_calls": [call]}


def test_strict_ignores_fields_no_template_reads() -> None:
    assert strict(REPLY, {**REPLY, "refusal": None, "annotations": []})
    assert not strict(REPLY, reserialized(REPLY))
    assert not strict(REPLY, {k: v for k, v in REPLY.items() if k != "reasoning_content"})


def test_json_args_accepts_reserialized_arguments_only() -> None:
    assert json_args(REPLY, reserialized(REPLY))
    other_id = {**REPLY, "tool_calls": [{**CALL, "id": "c2"}]}
    other_args = {**REPLY, "tool_calls": [{**CALL, "function": {**CALL["function"],
                                                                 "arguments": '{"city": "Rome"}'}}]}
    assert not json_args(REPLY, other_id) and not json_args(REPLY, other_args)
    empty = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    assert json_args(empty, {**empty, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})


def test_loose_merges_different_calls_which_is_why_it_is_risky() -> None:
    different_call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "zz", "type": "function", "function": {"name": "rm", "arguments": "{}"}}]}
    assert loose(REPLY, different_call)


def test_user_matcher_by_import_path() -> None:
    assert load_matcher("milepost.session.matchers:loose") is loose
    with pytest.raises(ValueError, match="session_matcher"):
        load_matcher("exactish")
    with pytest.raises(ValueError, match="cannot import"):
        load_matcher("no_such_module_x:fn")


def _turn(session: Session, at, messages, *, prompt, out, finish="stop", experts=None):
    return session.add_turn(
        at, messages, None, prompt_ids=prompt, output_ids=out,
        logprobs=[-0.5] * len(out), weight_versions=["3"] * len(out), weight_version="3",
        finish_reason={"type": finish}, routed_experts=experts)


U1 = {"role": "user", "content": "q1"}
A1 = {"role": "assistant", "content": "a1"}
U2 = {"role": "user", "content": "q2"}
A2 = {"role": "assistant", "content": "a2"}
U3 = {"role": "user", "content": "q3"}


def test_linear_extends_tail_retries_once_and_refuses_divergence() -> None:
    s = Session("s", "linear", strict)
    assert s.attach([U1], None).at is s.root
    t1 = _turn(s, s.root, [U1, A1], prompt=[1, 2], out=[3])
    t2 = _turn(s, t1, [U1, A1, U2, A2], prompt=[4], out=[5, 6])
    assert s.attach([U1, A1, U2, A2, U3], None).at is t2
    retry = s.attach([U1, A1, U3], None)  # rolls back one assistant turn
    assert retry.at is t1 and retry.new_messages == [U3]
    with pytest.raises(SessionConflict, match="diverges .* at message 0"):
        s.attach([{"role": "user", "content": "other"}, A1, U2, A2, U3], None)
    with pytest.raises(SessionConflict, match="assistant message the model did not generate"):
        s.attach([U1, A1, U2, A2, U3, A2, U3], None)
    # Nothing above changed the stored history.
    assert s.tail is t2 and [t.id for t in s.leaves()] == [t2.id]
    t2b = _turn(s, t1, [U1, A1, U3, A2], prompt=[7], out=[8])
    assert s.leaves() == [t2b]  # the retry replaced the tail


def test_linear_first_prompt_may_carry_a_demonstration() -> None:
    s = Session("s", "linear", strict)
    demo = [U2, A2, U1]  # a few-shot exchange before the real question
    assert s.attach(demo, None).new_messages == demo
    t1 = _turn(s, s.root, demo + [A1], prompt=[1, 2], out=[3])
    assert s.attach(demo, None).at is s.root  # a retry of the first turn repeats its prompt
    with pytest.raises(SessionConflict, match=r"at message 1 \(assistant\), in content"):
        s.attach([U2, {"role": "assistant", "content": "other"}, U1], None)
    with pytest.raises(SessionConflict, match="assistant message the model did not generate"):
        s.attach(demo + [A1, U3, A2, U3], None)
    assert s.tail is t1


def test_branching_forks_and_yields_one_sequence_per_leaf() -> None:
    s = Session("s", "branching", strict)
    t1 = _turn(s, s.root, [U1, A1], prompt=[1, 2], out=[3])
    _turn(s, t1, [U1, A1, U2, A2], prompt=[4], out=[5])
    fork = s.attach([U1, {"role": "assistant", "content": "rewritten"}, U3], None)
    assert fork.at is s.root  # a compacted history forks at the deepest match
    _turn(s, s.root, [U1, {"role": "assistant", "content": "rewritten"}, U3, A2], prompt=[9],
          out=[10])
    assert len(s.leaves()) == 2


def test_truncated_turn_cannot_be_extended() -> None:
    for mode in ("linear", "branching"):
        s = Session("s", mode, strict)
        _turn(s, s.root, [U1, A1], prompt=[1], out=[2, 3], finish="length")
        with pytest.raises(SessionConflict, match="length limit"):
            s.attach([U1, A1, U2], None)


def test_sequence_masks_exactly_the_sampled_tokens() -> None:
    s = Session("s", "linear", strict)
    t1 = _turn(s, s.root, [U1, A1], prompt=[1, 2, 3], out=[10, 11])
    t2 = _turn(s, t1, [U1, A1, U2, A2], prompt=[4, 5], out=[12, 13, 14])
    sample = build_sample(s, t2)
    assert sample.tokens == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    assert sample.prompt_length == 3 and sample.response_length == 7
    assert sample.loss_mask == [1, 1, 0, 0, 1, 1, 1]
    sampled = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert sampled == t1.output_ids + t2.output_ids
    assert sample.rollout_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert sample.weight_versions == ["3"] * 7
    assert sample.status is Status.COMPLETED


def _experts(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype(np.int32).tobytes()).decode()


def test_routed_experts_come_from_the_call_that_processed_each_token() -> None:
    s = Session("s", "linear", strict)
    # (tokens - 1, layers=2, top_k=2) rows; turn 2's call recomputed rows 0..3 differently.
    r1 = np.arange(4 * 4).reshape(4, 2, 2)
    t1 = _turn(s, s.root, [U1, A1], prompt=[1, 2, 3], out=[10, 11], experts=_experts(r1))
    r2 = np.full((7, 2, 2), 99)
    r2[4:] = np.arange(3 * 4).reshape(3, 2, 2) + 100
    t2 = _turn(s, t1, [U1, A1, U2, A2], prompt=[4, 5], out=[12], experts=_experts(r2))
    got = np.frombuffer(base64.b64decode(stitch_routed_experts(t2.path())), np.int32)
    got = got.reshape(-1, 2, 2)
    assert got.shape == (len(t2.ids) - 1, 2, 2)
    assert (got[:4] == r1).all() and (got[4:] == r2[4:]).all()


def test_a_client_that_requires_a_routing_key_refuses_a_request_without_one() -> None:
    import asyncio

    import httpx

    from milepost.rollout.client import EngineClient

    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("a key-less request must not reach the router")

    async def go() -> None:
        client = EngineClient("http://router", require_routing_key=True,
                              transport=httpx.MockTransport(never))
        try:
            with pytest.raises(ValueError, match="requires a routing key"):
                await client.generate([1, 2], {"max_new_tokens": 1})
        finally:
            await client.aclose()

    asyncio.run(go())
