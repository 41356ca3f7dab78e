"""Fuzzing the engine's request endpoints (hypothesis, bounded): no 5xx, the server stays alive,
its KV returns to where it started, and a good request is still answered exactly as before."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from milepost.testing.server_process import ServerProcess

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 4,
                                                    "ignore_eos": True}}

# JSON values of every kind, including the awkward ones (huge ints, floats near limits,
# unicode, nesting); lone surrogates come as raw escapes below.
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)

SAMPLING_KEYS = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                 "stop", "stop_token_ids", "stop_regex", "ignore_eos", "n", "sampling_seed",
                 "skip_special_tokens", "no_stop_trim", "stream_interval", "custom_params",
                 "json_schema", "regex"]
TOP_KEYS = ["text", "input_ids", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
            "token_ids_logprob", "return_text_in_logprobs", "return_routed_experts", "stream",
            "extra_key", "priority", "lora_path", "image_data", "return_prompt_token_ids",
            "data_parallel_rank", "session_id"]


@st.composite
def generate_bodies(draw: st.DrawFn) -> dict:
    body = {"input_ids": draw(st.lists(st.integers(-2, 600), min_size=0, max_size=6)),
            "sampling_params": {"max_new_tokens": draw(st.integers(0, 4))}}
    for key in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=3, unique=True)):
        body[key] = draw(values)
    for key in draw(st.lists(st.sampled_from(SAMPLING_KEYS), max_size=4, unique=True)):
        body["sampling_params"][key] = draw(values)
    sp = body["sampling_params"]
    # keep accepted requests short: a fuzzed n or length must not make the run slow
    if isinstance(sp.get("n"), int) and sp["n"] > 4:
        sp["n"] = 4
    if sp.get("ignore_eos") is True or "max_new_tokens" not in sp or not isinstance(
            sp.get("max_new_tokens"), int) or sp["max_new_tokens"] > 4:
        sp["max_new_tokens"] = 4
    return body


requests = st.one_of(
    generate_bodies().map(lambda b: ("/generate", b)),
    st.builds(lambda p, m: ("/v1/completions", {"prompt": p, "max_tokens": m}),
              values, st.integers(0, 4)),
    st.builds(lambda p: ("/tokenize", {"prompt": p}), values),
    st.builds(lambda t: ("/detokenize", {"tokens": t}), values),
    st.builds(lambda r: ("/abort_request", r), st.dictionaries(st.sampled_from(["rid", "abort_all"]),
                                                                 values, max_size=2)),
    st.builds(lambda v: ("/update_weight_version", {"new_version": v}), values),
)
RAW = [b'{"text": "\\ud800"}', b'{"input_ids": [1], "rid": "\\udfff\\ud800"}',
       b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', b'{"input_ids": [1e400]}',
       b'{"input_ids": [1], "sampling_params": {"stop": "\\ud83d"}}', b"\xff\xfe", b"{" * 1000]


def _used_tokens(srv: ServerProcess) -> int:
    return httpx.get(f"{srv.url}/v1/loads", timeout=10).json()["loads"][0]["num_used_tokens"]


def test_fuzzed_requests_never_5xx(qwen3_dir: Path) -> None:
    with ServerProcess(qwen3_dir, "--max-total-tokens", "4096") as srv:
        client = httpx.Client(base_url=srv.url, timeout=60)
        reference = client.post("/generate", json=GOOD).json()["output_ids"]
        start = _used_tokens(srv)
        seen: list[int] = []

        @hypothesis.settings(max_examples=150, deadline=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(requests)
        def check(req: tuple[str, object]) -> None:
            path, body = req
            r = client.post(path, json=body)
            seen.append(r.status_code)
            assert r.status_code < 500, f"{path} {body!r} -> {r.status_code}: {r.text[:300]}"

        check()
        for raw in RAW:
            r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (raw[:40], r.status_code, r.text[:200])
        assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)
        assert client.get("/health").status_code == 200
        deadline = time.monotonic() + 60
        while _used_tokens(srv) != start:
            assert time.monotonic() < deadline, "KV did not return to its start value"
            time.sleep(0.2)
        client.post("/update_weight_version", json={"new_version": "default"})
        assert client.post("/generate", json=GOOD).json()["output_ids"] == reference
        client.close()
