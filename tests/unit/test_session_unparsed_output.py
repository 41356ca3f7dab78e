"""Model output the family's parser cannot read (issue 16, bad input): a tool-call block with bad
JSON stays in the reply as text, the turn is stored token for token, the count reaches the
sample's metadata and the rollout metric, and the session goes on from it uncorrupted."""

from __future__ import annotations

import asyncio

from milepost.rollout.engine_output import GenerateOutput
from milepost.session.families import get_family
from milepost.session.matchers import load_matcher
from milepost.session.render import Renderer
from milepost.session.service import SessionService, SessionSettings
from milepost.testing.tokenizer import build_tiny_tokenizer

BAD_CALL = '<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {city}\n</tool_call>'


class ScriptedEngine:
    """Writes the bad call first, then a plain answer; records the prompts it was sent."""

    def __init__(self, r: Renderer) -> None:
        self.r = r
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def generate(self, input_ids, params, **_: object) -> GenerateOutput:
        self.prompts.append(list(input_ids))
        text = BAD_CALL if len(self.prompts) == 1 else "<think>\n\n</think>\n\nSorry."
        ids = self.r.encode(text) + [self.r.eot_id]
        self.outputs.append(ids)
        return GenerateOutput(output_ids=ids, text="", logprobs=[-0.5] * len(ids),
                              weight_versions=["1"] * len(ids), finish_reason={"type": "stop"},
                              weight_version="1", prompt_tokens=len(input_ids), cached_tokens=0)


def test_an_unparsable_tool_call_is_stored_as_text_and_counted() -> None:
    r = Renderer(build_tiny_tokenizer(), get_family("qwen3"))
    engine = ScriptedEngine(r)
    service = SessionService(r, engine, load_matcher("strict"), SessionSettings(mode="linear"))
    sid = service.create().id
    messages = [{"role": "user", "content": "Weather in Oslo?"}]

    first = asyncio.run(service.turn(sid, messages, None, {}))
    assert "tool_calls" not in first.reply
    assert first.reply["content"].startswith("<tool_call>") and "{city}" in first.reply["content"]
    assert first.reply["reasoning_content"] == "Call it."
    assert first.turn.unparsed_tool_calls == 1

    messages += [first.reply, {"role": "user", "content": "That did not parse."}]
    second = asyncio.run(service.turn(sid, messages, None, {}))
    assert second.reply["content"] == "Sorry." and second.divergence is None
    # The second prompt extends what the engine saw and produced the first time, token for token.
    seen = engine.prompts[0] + engine.outputs[0]
    assert engine.prompts[1][:len(seen)] == seen

    (sample,) = service.samples(sid)
    assert sample.metadata["session_unparsed_tool_calls"] == 1
    n_prompt = len(sample.tokens) - sample.response_length
    trained = [t for t, m in zip(sample.tokens[n_prompt:], sample.loss_mask, strict=True) if m]
    assert trained == engine.outputs[0] + engine.outputs[1]
