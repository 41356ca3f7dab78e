"""A black-box agent harness for tests and benchmarks: a tool-calling loop over the OpenAI chat
API that, like real harnesses, need not replay the model's messages verbatim (report 2.4.2):
it can reserialize tool-call arguments and drop reasoning content before the next request.

`RecordingTransport` sits between the session server and the engine and keeps every `/generate`
exchange as it went over the wire, so a test can compare training sequences with what the engine
actually returned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

WEATHER = {"Paris": "sunny", "Oslo": "snow", "Rome": "hot", "Lima": "mild", "Cairo": "hot",
           "Tokyo": "rain", "Quito": "windy", "Bern": "snow"}


def replay(message: dict[str, Any], *, reserialize_args: bool, drop_reasoning: bool,
           ) -> dict[str, Any]:
    """The assistant message as the harness sends it back next turn."""
    msg = {k: v for k, v in message.items() if not (drop_reasoning and k == "reasoning_content")}
    if reserialize_args and msg.get("tool_calls"):
        msg["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": json.dumps(
                json.loads(c["function"]["arguments"]), separators=(",", ":"), sort_keys=True,
                indent=1)}}
            for c in msg["tool_calls"]]
    return msg


@dataclass
class WeatherAgent:
    """Ask for a city's weather, run the tool calls the model makes, thank it; `max_turns` model
    calls at most. Every answer and every error status is kept."""

    base_url: str  # {session server}/sessions/{id}/v1
    reserialize_args: bool = False
    drop_reasoning: bool = False
    max_turns: int = 6
    sampling: dict[str, Any] = field(default_factory=lambda: {"max_tokens": 96,
                                                              "temperature": 1.0})
    messages: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)

    def run(self, city: str, client: httpx.Client, *, thanks_rounds: int = 1) -> None:
        self.messages = [{"role": "user", "content": f"Weather in {city}?"}]
        thanked = 0
        for _ in range(self.max_turns):
            resp = client.post(f"{self.base_url}/chat/completions",
                               json={"messages": self.messages, **self.sampling})
            resp.raise_for_status()
            body = resp.json()
            self.answers.append(body)
            choice = body["choices"][0]
            msg = choice["message"]
            if choice["finish_reason"] == "length":
                return
            self.messages.append(replay(msg, reserialize_args=self.reserialize_args,
                                        drop_reasoning=self.drop_reasoning))
            if msg.get("tool_calls"):
                for call in msg["tool_calls"]:
                    args = json.loads(call["function"]["arguments"] or "{}")
                    self.messages.append({"role": "tool", "tool_call_id": call["id"],
                                          "content": WEATHER.get(args.get("city"), "unknown")})
            elif thanked < thanks_rounds:
                thanked += 1
                self.messages.append({"role": "user", "content": "Thanks!"})
            else:
                return


class RecordingTransport(httpx.AsyncBaseTransport):
    """The network, plus a record of every /generate request body and answer body."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.generate_calls: list[tuple[dict[str, Any], dict[str, Any], dict[str, str]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if not request.url.path.endswith("/generate"):
            return response
        sent = json.loads(request.content)
        if sent.get("stream"):  # pass chunks on as they come; record the last (cumulative) one
            return httpx.Response(response.status_code, headers=response.headers,
                                  stream=_RecordedStream(response, sent, dict(request.headers),
                                                         self.generate_calls))
        body = await response.aread()
        self.generate_calls.append((sent, json.loads(body), dict(request.headers)))
        return httpx.Response(response.status_code, headers=response.headers, content=body)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _RecordedStream(httpx.AsyncByteStream):
    def __init__(self, response: httpx.Response, sent: dict[str, Any], headers: dict[str, str],
                 calls: list) -> None:
        self._response, self._sent, self._headers, self._calls = response, sent, headers, calls
        self._buf = b""

    async def __aiter__(self):
        async for part in self._response.aiter_raw():
            self._buf += part
            yield part

    async def aclose(self) -> None:  # the reader may stop at [DONE]: record here
        await self._response.aclose()
        events = [line[5:].strip() for line in self._buf.decode().splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        if events:
            self._calls.append((self._sent, json.loads(events[-1]), self._headers))


async def weather_agent_fn(ctx: Any) -> Any:
    """An agent fn (milepost.rollout.layers.AgentFn) of the weather task: the item's prompt asks
    for a city's weather; the agent runs the model's tool calls until it answers. Reward 1 when
    the answer names the city's true condition (the item's label), else 0."""
    return await _weather_episode(ctx, drop_reasoning=False)


async def forking_weather_agent_fn(ctx: Any) -> Any:
    """The weather agent, replaying the model's messages without their reasoning (as harnesses
    that compact their context do): under the strict matcher a branching session forks at each
    replay, so one episode leaves several leaves."""
    return await _weather_episode(ctx, drop_reasoning=True)


async def _weather_episode(ctx: Any, drop_reasoning: bool) -> Any:
    from milepost.rollout.layers import AgentOutcome

    prompt = ctx.item.prompt
    messages = (list(prompt) if isinstance(prompt, list)
                else [{"role": "user", "content": str(prompt)}])
    answer = ""
    for turn in range(4):
        resp = await ctx.http.post(f"{ctx.base_url}/chat/completions", json={
            "messages": messages, "max_tokens": ctx.max_new_tokens})
        if resp.status_code >= 400:
            return AgentOutcome(reward=0.0, metadata={"agent_error": resp.text[:200]})
        choice = resp.json()["choices"][0]
        msg = choice["message"]
        messages.append(replay(msg, reserialize_args=False, drop_reasoning=drop_reasoning))
        if choice["finish_reason"] != "tool_calls":
            answer = msg.get("content") or ""
            break
        for call in msg["tool_calls"]:
            try:
                city = json.loads(call["function"]["arguments"]).get("city")
            except (json.JSONDecodeError, AttributeError):
                city = None
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": WEATHER.get(city, "unknown")})
    truth = str(ctx.item.label or "")
    return AgentOutcome(reward=float(bool(truth) and truth in answer),
                        metadata={"agent_turns": turn + 1, "answer": answer})
