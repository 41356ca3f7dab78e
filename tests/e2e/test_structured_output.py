"""Structured output against a real `milepost serve` process (the tiny Qwen3, random weights).

A random model follows no format by itself, so every output that parses is the grammar's doing:
json_schema outputs parse and validate, regex outputs match, an EBNF output is one of its words;
grammar rows share a batch with free rows without changing them; n > 1, abort and a bad schema.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from milepost.testing.server_process import ServerProcess

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
WHITESPACE = [" ", "\n", "\t", "\r", "  "]


def post(srv: ServerProcess, body: dict, path: str = "/generate") -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=300)


def no_whitespace_bias(tok) -> dict[str, float]:
    """JSON allows any whitespace between tokens (SGLang's default too); a random model may spend
    its whole budget there, so the test biases it away (logit_bias and the mask together)."""
    ids = {i for w in WHITESPACE for i in tok.encode(w)}
    return {str(i): -100.0 for i in ids}


def check_doc(text: str) -> None:
    doc = json.loads(text)
    assert set(doc) == set(SCHEMA["required"]), text
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 6
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool)
    assert 0 <= doc["age"] <= 99 and isinstance(doc["ok"], bool) and doc["tag"] in ("red", "blue")


def test_json_schema_outputs_parse_and_validate_with_n_and_a_batch(
        qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    sp = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 120, "temperature": 1.0, "n": 3,
          "sampling_seed": 7, "logit_bias": no_whitespace_bias(qwen3_tokenizer)}
    r = post(qwen3_server, {"text": ["Give me a record:", "JSON please"], "sampling_params": sp,
                            "return_logprob": True})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 6
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        check_doc(o["text"])
        lps = [e[0] for e in o["meta_info"]["output_token_logprobs"]]
        assert all(lp <= 0.0 and lp > float("-inf") for lp in lps)
    assert len({o["text"] for o in outs}) > 1, "n samples of a seeded request should differ"


def test_regex_and_ebnf_in_a_mixed_batch_leave_free_rows_unchanged(qwen3_server: ServerProcess) -> None:
    free = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    regex = r"[0-9]{3}-[a-z]{2,4}"
    body = {"text": ["one", "two", "three"], "sampling_params": [
        free, {"regex": regex, "max_new_tokens": 30, "temperature": 1.0},
        {"ebnf": 'root ::= "yes" | "no" | "maybe"', "max_new_tokens": 10, "temperature": 1.0}]}
    r = post(qwen3_server, body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert re.fullmatch(regex, outs[1]["text"]), outs[1]["text"]
    assert outs[2]["text"] in ("yes", "no", "maybe")
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs[1:])
    alone = post(qwen3_server, {"text": "one", "sampling_params": free}).json()
    assert outs[0]["output_ids"] == alone["output_ids"]  # greedy: the grammar rows changed nothing


def test_grammar_requests_can_be_aborted(qwen3_server: ServerProcess) -> None:
    result: dict = {}

    def run() -> None:  # a long grammar request: 400 letters
        result["r"] = post(qwen3_server, {"text": "x", "rid": "grammar-abort", "sampling_params": {
            "regex": "[a-z]{400}", "max_new_tokens": 400, "temperature": 1.0}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the engine runs it
        load = httpx.get(f"{qwen3_server.url}/get_load", timeout=30).json()
        if load[0]["num_reqs"] > 0:
            break
        time.sleep(0.05)
    assert httpx.post(f"{qwen3_server.url}/abort_request", json={"rid": "grammar-abort"},
                      timeout=30).status_code == 200
    t.join(timeout=300)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert re.fullmatch("[a-z]*", out["text"]) and len(out["text"]) < 400


@pytest.mark.parametrize(("sp", "words"), [
    ({"json_schema": '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'},
     ["sampling_params.json_schema", "nonsense"]),
    ({"json_schema": "{oops"}, ["sampling_params.json_schema", "JSON"]),
    ({"regex": "[a-"}, ["sampling_params.regex"]),
])
def test_a_bad_grammar_is_a_400_naming_the_field_and_the_server_goes_on(
        qwen3_server: ServerProcess, sp: dict, words: list[str]) -> None:
    r = post(qwen3_server, {"text": "hi", "sampling_params": sp})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg
    ok = post(qwen3_server, {"text": "hi", "sampling_params": {"regex": "[ab]", "max_new_tokens": 4}})
    assert ok.status_code == 200 and ok.json()["text"] in ("a", "b")


def test_openai_response_format_on_chat_and_completions(qwen3_server: ServerProcess,
                                                        qwen3_tokenizer) -> None:
    bias = no_whitespace_bias(qwen3_tokenizer)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    chat = post(qwen3_server, {"messages": [{"role": "user", "content": "a record"}],
                               "response_format": fmt, "max_tokens": 120, "seed": 3, "n": 2,
                               "logit_bias": bias}, "/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    for choice in chat.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        check_doc(choice["message"]["content"])
    done = post(qwen3_server, {"prompt": "an object:", "response_format": {"type": "json_object"},
                               "max_tokens": 120, "seed": 5, "logit_bias": bias}, "/v1/completions")
    assert done.status_code == 200, done.text
    choice = done.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may nest objects past the budget
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].startswith("{")
    bad = post(qwen3_server, {"prompt": "x", "response_format": {"type": "json_schema"}},
               "/v1/completions")
    assert bad.status_code == 400 and "response_format.json_schema" in bad.text
    bad = post(qwen3_server, {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nonsense"}}}},
        "/v1/completions")
    assert bad.status_code == 400 and "response_format.json_schema" in bad.text, bad.text


def test_a_streamed_grammar_request(qwen3_server: ServerProcess) -> None:
    regex = r"(ab|cd){2,6}!"
    with httpx.stream("POST", f"{qwen3_server.url}/generate", timeout=300, json={
            "text": "go", "stream": True, "sampling_params": {
                "regex": regex, "max_new_tokens": 40, "n": 2, "sampling_seed": 1}}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    last = {}
    for c in chunks:
        last[c["index"]] = c
    assert sorted(last) == [0, 1]
    for c in last.values():
        assert c["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(regex, c["text"]), c["text"]
