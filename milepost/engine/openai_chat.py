"""The engine's `/v1/chat/completions`: the checkpoint's chat template renders the messages, the
tools and `chat_template_kwargs`; the answer is read back with a model family's parser (the
session server's, milepost/session/families.py) when the engine was started with
`--tool-call-parser NAME`, as SGLang's is; log-probs come in OpenAI's shape; `stream` sends
`chat.completion.chunk` events, tool calls whole at the end of a choice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request as HttpRequest
from starlette.responses import StreamingResponse

from milepost.engine.generate_service import OPENAI_NAMES, BadRequest, GenerateService
from milepost.engine.protocol import GenerateReqInput
from milepost.session.families import Family, FamilyError, family_names, get_family
from milepost.session.openai_chat import IncrementalText
from milepost.session.parsers import parse_think
from milepost.session.render import args_as_objects
from milepost.session.streaming import DeltaStream

# SGLang's --tool-call-parser names -> milepost's families (either name works).
SGLANG_PARSERS = {"qwen": "qwen3", "qwen25": "qwen2.5", "llama3": "llama3",
                  "deepseekv3": "deepseek-v3", "kimi_k2": "kimi-k2", "glm45": "glm4",
                  "mistral": "mistral", "gpt-oss": "gpt-oss"}
# apply_chat_template's own arguments: chat_template_kwargs must not set them.
_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
             "add_generation_prompt", "continue_final_message", "return_dict", "padding",
             "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
             "tokenizer_kwargs"}


def tool_call_family(name: str | None) -> Family | None:
    """The family named by `--tool-call-parser` (a milepost family or SGLang's parser name)."""
    if name is None:
        return None
    if SGLANG_PARSERS.get(name, name) not in family_names():
        raise FamilyError(f"--tool-call-parser: unknown parser {name!r}; a model family "
                          f"{[f for f in family_names() if f != 'generic']} or SGLang's name of "
                          f"one {sorted(k for k, v in SGLANG_PARSERS.items() if v in family_names())}")
    family = get_family(SGLANG_PARSERS.get(name, name))
    if not family.checked:
        raise FamilyError(f"--tool-call-parser {name}: the family has no parser; name the "
                          f"checkpoint's family")
    return family


def render_prompt(service: GenerateService, req: Any, family: Family | None) -> list[int]:
    """Token ids of the chat template's rendering of the request (400 when it cannot)."""
    tok = service.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise BadRequest("messages: this model has no chat template; use /v1/completions")
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    if tools and family is None:
        raise BadRequest("tools: this engine reads no tool calls from the model's output; start "
                         "it with --tool-call-parser FAMILY (the checkpoint's family, e.g. qwen3)")
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(set(kwargs) & _RESERVED)
    if clash:
        raise BadRequest(f"chat_template_kwargs: {clash} are request fields, not template "
                         f"variables")
    messages = [m.for_template() for m in req.messages]
    if family is not None and family.tool_args_as_objects:
        messages = [args_as_objects(m) for m in messages]
    final = req.continue_final_message
    if final and messages[-1]["role"] != "assistant":
        raise BadRequest("continue_final_message: the last message must be an assistant message")
    try:
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=not final,
                                      continue_final_message=final, tokenize=True,
                                      return_dict=False, **kwargs)
    except Exception as e:
        raise BadRequest(f"messages: the model's chat template cannot render them "
                         f"({type(e).__name__}: {e})") from e
    return list(ids)


class ChatReader:
    """Output ids of one choice -> its OpenAI message (the family's parser, or the plain text)."""

    def __init__(self, service: GenerateService, family: Family | None, parse_tools: bool) -> None:
        self.tokenizer = service.tokenizer
        self.family = family
        self.parse_tools = parse_tools
        self.stop_ids = set(service.info.eos_token_ids)
        # The family's end-of-turn ids join the engine's stop ids.
        self.end_ids: set[int] = set()
        if family is not None:
            for marker in family.turn_ends:
                (tid,) = self.tokenizer.convert_tokens_to_ids([marker]) or [None]
                if tid is not None and tid != self.tokenizer.unk_token_id:
                    self.end_ids.add(tid)
            self.stop_ids |= self.end_ids

    def raw_text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def message(self, out: dict) -> dict[str, Any]:
        if self.family is None:
            return {"role": "assistant", "content": out["text"]}
        raw = self.raw_text(out["output_ids"])
        msg = self.family.parse(raw).message()
        if not self.parse_tools and msg.get("tool_calls"):
            # tool_choice none (or no tools): a call-shaped text stays content, as written.
            reasoning, rest = (parse_think(raw, *self.family.think_markers)
                               if self.family.think_markers else (None, raw))
            msg = {"role": "assistant", "content": rest}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
        return msg


def finish_reason(out: dict, message: dict) -> str:
    if out["meta_info"]["finish_reason"]["type"] == "length":
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def openai_logprobs(out: dict, top: int) -> dict[str, Any]:
    """SGLang's output_token_logprobs (+ output_top_logprobs) in OpenAI's `logprobs.content`."""
    def entry(lp: float, text: str) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    meta = out["meta_info"]
    rows = meta.get("output_top_logprobs") or [[] for _ in meta["output_token_logprobs"]]
    return {"content": [
        {**entry(lp, text or ""), "top_logprobs": [entry(tlp, tt or "") for tlp, _, tt in row[:top]]}
        for (lp, _, text), row in zip(meta["output_token_logprobs"], rows)]}


async def chat_completion(service: GenerateService, req: Any, http: HttpRequest,
                          family: Family | None) -> dict | StreamingResponse:
    ids = render_prompt(service, req, family)
    reader = ChatReader(service, family, parse_tools=bool(req.tools) and req.tool_choice != "none")
    params = req.sampling()
    if reader.end_ids - set(service.info.eos_token_ids):
        params = params.model_copy(update={"stop_token_ids": sorted(
            set(params.stop_token_ids or []) | reader.end_ids)})
    body = GenerateReqInput(input_ids=ids, sampling_params=params, return_logprob=req.logprobs,
                            top_logprobs_num=req.top_logprobs,
                            return_text_in_logprobs=req.logprobs, stream=req.stream)
    seqs = await service.expand(body, names=replace(OPENAI_NAMES, prompt="messages"))
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(service, seqs, body, reader, req.model, cid, created,
                                         len(ids), usage), media_type="text/event-stream")
    outs = await service.run_all(seqs, body, http.is_disconnected)
    choices = []
    for i, o in enumerate(outs):
        msg = reader.message(o)
        choices.append({"index": i, "message": msg, "finish_reason": finish_reason(o, msg),
                        "logprobs": openai_logprobs(o, req.top_logprobs) if req.logprobs
                        else None})
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"id": cid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": choices, "usage": {"prompt_tokens": len(ids),
                                          "completion_tokens": completion,
                                          "total_tokens": len(ids) + completion}}


async def _stream(service: GenerateService, seqs: list, body: GenerateReqInput, reader: ChatReader,
                  model: str, cid: str, created: int, prompt_tokens: int, include_usage: bool,
                  ) -> AsyncIterator[str]:
    """Chunks of every choice as the engine produces them; content (and reasoning) deltas that no
    continuation can change, tool calls whole when a choice ends."""
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def event(index: int, delta: dict, finish: str | None = None) -> str:
        return "data: " + json.dumps({**base, "choices": [{
            "index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]},
            ensure_ascii=False) + "\n\n"

    n = len(seqs)
    ids: list[list[int]] = [[] for _ in range(n)]
    plain = [""] * n  # no family: the engine's text so far
    sent = [""] * n
    texts = [IncrementalText(lambda x: reader.raw_text(x)) for _ in range(n)]
    deltas = [DeltaStream(reader.family) if reader.family else None for _ in range(n)]
    completion = 0
    for i in range(n):
        yield event(i, {"role": "assistant", "content": ""})
    async for raw in service.stream(seqs, body):
        if raw.startswith(b"data: [DONE]"):
            break
        chunk = json.loads(raw[len(b"data: "):])
        i = chunk.get("index", 0)
        if service.incremental_stream:
            ids[i] += chunk["output_ids"]
            plain[i] += chunk["text"]
        else:
            ids[i], plain[i] = list(chunk["output_ids"]), chunk["text"]
        done = chunk["meta_info"]["finish_reason"] is not None
        if deltas[i] is None:  # plain text: hold back an unfinished character
            text = plain[i] if done else plain[i].rstrip("\ufffd")
            if len(text) > len(sent[i]) and text.startswith(sent[i]):
                yield event(i, {"content": text[len(sent[i]):]})
                sent[i] = text
            msg = {"role": "assistant", "content": text}
        else:
            stop_trimmed = ids[i][:-1] if ids[i] and ids[i][-1] in reader.stop_ids else ids[i]
            for d in deltas[i].update(texts[i].update(stop_trimmed)):
                yield event(i, d)
            if done:
                msg = reader.message({"output_ids": ids[i], "text": plain[i]})
                for d in deltas[i].finish(msg):
                    yield event(i, d)
        if done:
            completion += len(ids[i])
            yield event(i, {}, finish_reason({"meta_info": chunk["meta_info"]}, msg))
    if include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}}) + "\n\n"
    yield "data: [DONE]\n\n"
