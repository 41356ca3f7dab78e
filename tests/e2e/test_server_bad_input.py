"""Bad requests get a 4xx whose message names the field at fault, and the server keeps serving.

Messages must read as the client's mistake ("malformed JSON", "sampling_params.top_p: ..."), not
as pydantic internals (union member names, "JSON decode error").
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from milepost.testing.server_process import ServerProcess

OK = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
SP = "sampling_params"

# (id, path, JSON body or raw bytes, words the message must contain)
CASES: list[tuple[str, str, object, list[str]]] = [
    ("malformed-json", "/generate", b'{"text": "hi",', ["body", "malformed JSON"]),
    ("json-array-body", "/generate", b"[1, 2]", ["body", "JSON object", "array"]),
    ("json-string-body", "/generate", b'"hello"', ["body", "JSON object", "string"]),
    ("null-body", "/generate", b"null", ["body", "JSON object", "null"]),
    ("empty-body", "/generate", b"", ["body", "JSON object", "empty"]),
    ("max-new-tokens-not-int", "/generate",
     {"text": "hi", SP: {"max_new_tokens": "abc"}}, ["sampling_params.max_new_tokens", "integer"]),
    ("unknown-sampling-param", "/generate",
     {"text": "hi", SP: {"temprature": 0.5}}, ["sampling_params.temprature", "unknown field"]),
    ("unknown-top-level-field", "/generate", {"text": "hi", "max_tokens": 3},
     ["max_tokens", "unknown field"]),
    ("text-and-input-ids", "/generate", {"text": "hi", "input_ids": [1]}, ["text, input_ids:"]),
    ("neither-text-nor-input-ids", "/generate", {SP: {"max_new_tokens": 1}}, ["text, input_ids:"]),
    ("text-not-string", "/generate", {"text": 5}, ["text", "string"]),
    ("empty-text", "/generate", {"text": ""}, ["text", "empty"]),
    ("empty-input-ids", "/generate", {"input_ids": []}, ["input_ids", "empty"]),
    ("empty-batch", "/generate", {"text": []}, ["text", "batch is empty"]),
    ("empty-prompt-in-batch", "/generate", {"input_ids": [[1, 2], []]}, ["input_ids[1]", "empty"]),
    ("token-id-not-int", "/generate", {"input_ids": [1, "a"]}, ["input_ids[1]", "integer"]),
    ("token-id-beyond-vocab", "/generate", {"input_ids": [1, 512]}, ["input_ids", "512", "vocabulary"]),
    ("token-id-negative", "/generate", {"input_ids": [1, -1]}, ["input_ids", "-1", "vocabulary"]),
    ("beyond-context-length", "/generate",
     {"input_ids": [1, 2], SP: {"max_new_tokens": 5000}},
     ["sampling_params.max_new_tokens", "context length 2048"]),
    ("negative-max-new-tokens", "/generate",
     {"input_ids": [1], SP: {"max_new_tokens": -1}}, ["sampling_params.max_new_tokens"]),
    ("negative-temperature", "/generate",
     {"input_ids": [1], SP: {"temperature": -0.5}}, ["sampling_params.temperature"]),
    ("top-p-zero", "/generate", {"input_ids": [1], SP: {"top_p": 0}}, ["sampling_params.top_p"]),
    ("top-k-negative", "/generate", {"input_ids": [1], SP: {"top_k": -5}}, ["top_k"]),
    ("min-above-max-new-tokens", "/generate",
     {"input_ids": [1], SP: {"min_new_tokens": 9, "max_new_tokens": 3}}, ["min_new_tokens"]),
    ("empty-stop-string", "/generate", {"input_ids": [1], SP: {"stop": ""}}, ["stop"]),
    ("sampling-params-string", "/generate", {"text": "hi", SP: "greedy"},
     ["sampling_params", "JSON object", "string"]),
    # an id outside the vocabulary once crashed the engine loop when min_new_tokens banned it
    ("stop-token-id-beyond-vocab", "/generate",
     {"input_ids": [1], SP: {"stop_token_ids": [99999], "min_new_tokens": 1}},
     ["sampling_params.stop_token_ids", "99999"]),
    ("stop-token-id-negative", "/generate",
     {"input_ids": [1], SP: {"stop_token_ids": [-5], "min_new_tokens": 1}},
     ["sampling_params.stop_token_ids", "-5"]),
    ("sampling-seed-beyond-64-bit", "/generate",
     {"input_ids": [1], SP: {"sampling_seed": 2**64}}, ["sampling_params.sampling_seed"]),
    ("duplicate-rids-in-batch", "/generate", {"text": ["a", "b"], "rid": ["x", "x"]},
     ["rid", "unique"]),
    ("rid-list-too-short", "/generate", {"text": ["a", "b"], "rid": ["x"]}, ["rid", "2 prompts"]),
    ("sampling-params-per-prompt-mismatch", "/generate",
     {"input_ids": [[1], [2]], SP: [{"max_new_tokens": 1}]}, ["sampling_params:", "2 prompts"]),
    ("bad-entry-in-sampling-params-list", "/generate",
     {"input_ids": [[1], [2]], SP: [{"max_new_tokens": 1}, {"top_p": 2}]},
     ["sampling_params[1].top_p"]),
    ("top-logprobs-num-negative", "/generate", {"input_ids": [1], "top_logprobs_num": -1},
     ["top_logprobs_num"]),
    ("logprob-start-beyond-prompt", "/generate",
     {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
     ["logprob_start_len", "0 to 1"]),
    ("logprob-start-below-minus-one", "/generate", {"input_ids": [1], "logprob_start_len": -2},
     ["logprob_start_len"]),
    ("token-ids-logprob-beyond-vocab", "/generate",
     {"input_ids": [1], "return_logprob": True, "token_ids_logprob": [3, 700]},
     ["token_ids_logprob", "700"]),
    # SGLang's fields: out-of-range values and fields that cannot apply here name themselves
    ("frequency-penalty-out-of-range", "/generate", {"input_ids": [1], SP: {"frequency_penalty": 2.5}},
     ["sampling_params.frequency_penalty"]),
    ("repetition-penalty-zero", "/generate", {"input_ids": [1], SP: {"repetition_penalty": 0}},
     ["sampling_params.repetition_penalty"]),
    ("logit-bias-beyond-vocab", "/generate", {"input_ids": [1], SP: {"logit_bias": {"900": 1.0}}},
     ["sampling_params.logit_bias", "900"]),
    ("logit-bias-key-not-an-id", "/generate", {"input_ids": [1], SP: {"logit_bias": {"a": 1.0}}},
     ["sampling_params.logit_bias", "'a'"]),
    ("stop-regex-invalid", "/generate", {"input_ids": [1], SP: {"stop_regex": "(ab"}},
     ["sampling_params.stop_regex", "regular expression"]),
    ("json-schema-invalid", "/generate", {"input_ids": [1], SP: {"json_schema": '{"type": 3}'}},
     ["sampling_params.json_schema"]),
    ("regex-invalid", "/generate", {"input_ids": [1], SP: {"regex": "a(b"}},
     ["sampling_params.regex", "unclosed group"]),
    ("two-grammars", "/generate", {"input_ids": [1], SP: {"regex": "a", "ebnf": "root ::= \"a\""}},
     ["regex and ebnf", "only one"]),
    ("stream-interval-zero", "/generate", {"input_ids": [1], SP: {"stream_interval": 0}},
     ["sampling_params.stream_interval"]),
    ("lora-path", "/generate", {"input_ids": [1], "lora_path": "adapter"}, ["lora_path", "LoRA"]),
    ("image-data", "/generate", {"text": "hi", "image_data": "x.png"}, ["image_data", "text"]),
    ("custom-logit-processor", "/generate", {"input_ids": [1], "custom_logit_processor": "x"},
     ["custom_logit_processor"]),
    ("data-parallel-rank", "/generate", {"input_ids": [1], "data_parallel_rank": 1},
     ["data_parallel_rank", "one data-parallel rank"]),
    ("return-hidden-states", "/generate", {"input_ids": [1], "return_hidden_states": True},
     ["return_hidden_states"]),
    # coercions and non-finite numbers (issue 19)
    ("return-logprob-string", "/generate", {"input_ids": [1], "return_logprob": "yes"},
     ["return_logprob", "boolean"]),
    ("input-ids-strings", "/generate", {"input_ids": ["1"]}, ["input_ids[0]", "integer"]),
    ("input-ids-booleans", "/generate", {"input_ids": [True]}, ["input_ids[0]", "integer"]),
    ("temperature-infinity", "/generate",
     b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}',
     ["sampling_params.temperature", "finite"]),
    ("top-p-nan", "/generate", b'{"input_ids": [1], "sampling_params": {"top_p": NaN}}',
     ["sampling_params.top_p"]),
    ("max-new-tokens-string", "/generate", {"input_ids": [1], SP: {"max_new_tokens": "8"}},
     ["sampling_params.max_new_tokens", "integer"]),
    # lone surrogates: valid JSON escapes that are not Unicode text (issue 19)
    ("surrogate-in-text", "/generate", b'{"text": "a\\ud800b"}', ["text", "surrogate"]),
    ("surrogate-in-rid", "/generate", b'{"input_ids": [1], "rid": "\\udc00"}', ["rid", "surrogate"]),
    ("surrogate-in-stop", "/generate",
     b'{"input_ids": [1], "sampling_params": {"stop": ["\\ud83d"]}}',
     ["sampling_params.stop[0]", "surrogate"]),
    ("surrogate-in-weight-version", "/update_weight_version", b'{"new_version": "\\ud800"}',
     ["new_version", "surrogate"]),
    ("v1-surrogate-in-prompt", "/v1/completions", b'{"prompt": "\\udfff"}', ["prompt", "surrogate"]),
    ("unknown-pause-mode", "/pause_generation", {"mode": "pause"}, ["mode", "retract"]),
    ("abort-without-rid", "/abort_request", {}, ["rid"]),
    ("abort-non-object", "/abort_request", b'["r1"]', ["body", "JSON object"]),
    ("weight-version-missing", "/update_weight_version", {}, ["new_version"]),
    ("v1-empty-prompt", "/v1/completions", {"prompt": ""}, ["prompt", "empty"]),
    ("v1-beyond-context", "/v1/completions", {"prompt": "hi", "max_tokens": 5000},
     ["max_tokens: prompt (2 tokens) + max_tokens (5000)", "context length"]),
    ("v1-negative-temperature", "/v1/completions", {"prompt": "hi", "temperature": -1},
     ["temperature"]),
    ("v1-empty-stop", "/v1/completions", {"prompt": "hi", "stop": ""}, ["stop"]),
    ("v1-stream", "/v1/completions", {"prompt": "hi", "stream": True}, ["stream"]),
    ("v1-logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 2}, ["logprobs"]),
    ("v1-echo", "/v1/completions", {"prompt": "hi", "echo": True}, ["echo"]),
    ("v1-penalty-out-of-range", "/v1/completions", {"prompt": "hi", "presence_penalty": 3},
     ["presence_penalty"]),
    ("v1-temperature-infinity", "/v1/completions", b'{"prompt": "hi", "temperature": Infinity}',
     ["temperature"]),
    ("v1-empty-prompt-in-batch", "/v1/completions", {"prompt": ["hi", ""]}, ["prompt[1]", "empty"]),
    ("v1-token-beyond-vocab", "/v1/completions", {"prompt": [1, 600]}, ["prompt", "600"]),
    ("v1-chat-no-messages", "/v1/chat/completions", {"messages": []}, ["messages"]),
    # the chat template raises on these: a client error, not a 500
    ("v1-chat-unknown-role", "/v1/chat/completions",
     {"messages": [{"role": "alien", "content": "x"}]}, ["messages", "chat template", "alien"]),
    ("v1-chat-no-content", "/v1/chat/completions", {"messages": [{"role": "user"}]},
     ["messages", "chat template"]),
    ("v1-chat-late-system", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]},
     ["messages", "chat template"]),
    ("v1-chat-logprobs-stream", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "stream": True},
     ["logprobs", "stream"]),
    ("v1-chat-unknown-field", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "function_call": "auto"},
     ["function_call", "unknown field"]),
    ("v1-chat-malformed-json", "/v1/chat/completions", b'{"messages": [', ["body", "malformed JSON"]),
]

# Phrases of pydantic/FastAPI internals that must not reach clients.
INTERNALS = ["function-after", "list[", "JSON decode error", "dictionary or object to extract",
             "Value error,", "SamplingParams"]


@pytest.mark.parametrize(("path", "body", "words"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_names_the_field(qwen3_server: ServerProcess, path: str, body: object,
                                     words: list[str]) -> None:
    url = qwen3_server.url + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text}"
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    for phrase in INTERNALS:
        assert phrase not in message, f"internal phrase {phrase!r} in {message!r}"
    if "body" not in words:  # the message names a field, not the body as a whole
        assert not message.startswith("body"), message

    good = httpx.post(f"{qwen3_server.url}/generate", json=OK, timeout=30)
    assert good.status_code == 200, good.text
    assert good.json()["meta_info"]["completion_tokens"] == 1


def test_body_sent_without_json_content_type(qwen3_server: ServerProcess) -> None:
    r = httpx.post(f"{qwen3_server.url}/generate", content=b'{"input_ids": [1]}',
                   headers={"content-type": "text/plain"}, timeout=30)
    assert r.status_code == 400
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_bad_request_in_a_batch_submits_nothing(qwen3_server: ServerProcess) -> None:
    """A batch with one bad prompt is refused whole: no prompt of it starts generating."""
    before = httpx.get(f"{qwen3_server.url}/metrics", timeout=10).text
    r = httpx.post(f"{qwen3_server.url}/generate", timeout=30,
                   json={"input_ids": [[1, 2], [3, 9999]], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "input_ids[1]" in r.json()["error"]["message"]
    after = httpx.get(f"{qwen3_server.url}/metrics", timeout=10).text
    line = next(s for s in before.splitlines() if s.startswith("milepost:requests_finished_total"))
    assert line in after.splitlines()


def test_rid_already_running_is_refused(qwen3_server: ServerProcess) -> None:
    """SGLang refuses a duplicate rid; it must not abort or disturb the running request."""

    async def main() -> tuple[httpx.Response, dict]:
        async with httpx.AsyncClient(base_url=qwen3_server.url, timeout=60) as c:
            first = asyncio.create_task(c.post("/generate", json={
                "input_ids": [1, 2, 3], "rid": "dup-rid",
                "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}))
            try:
                deadline = time.monotonic() + 180  # idle: under a second; loaded: far slower
                while (await c.get("/get_server_info")).json()["num_running_reqs"] < 1:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                second = await c.post("/generate", json={"input_ids": [4], "rid": "dup-rid"})
            finally:
                await c.post("/abort_request", json={"rid": "dup-rid"})
            return second, (await first).json()

    second, first = asyncio.run(main())
    assert second.status_code == 400
    assert "rid" in second.json()["error"]["message"] and "dup-rid" in second.json()["error"]["message"]
    assert first["meta_info"]["id"] == "dup-rid"
    assert first["meta_info"]["finish_reason"]["type"] == "abort"  # by our abort_request
