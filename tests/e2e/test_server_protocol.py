"""SGLang's HTTP protocol, end to end against a real `milepost serve` process.

Field names and formats are SGLang's (finish_reason a dict, logprob entries [logprob, id, text],
SSE chunks ending in `data: [DONE]`); each test states what a SGLang client relies on.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from milepost.testing.server_process import ServerProcess

GREEDY = {"temperature": 0.0}


def generate(srv: ServerProcess, **body: object) -> dict | list:
    r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def greedy_ids(srv: ServerProcess, prompt: list[int], n: int) -> list[int]:
    out = generate(srv, input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n,
                                                           "ignore_eos": True})
    return out["output_ids"]


def server_info(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.url}/get_server_info", timeout=10).json()


def metrics(srv: ServerProcess) -> dict[str, float]:
    r = httpx.get(f"{srv.url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}


# ---- /generate: response format -------------------------------------------------------------
def test_generate_text_response_fields(qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    prompt = "hello world, tell me a story"
    out = generate(qwen3_server, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 8,
                                                               "ignore_eos": True},
                   return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    ids = out["output_ids"]
    assert len(ids) == 8 and all(isinstance(t, int) for t in ids)
    assert out["text"] == qwen3_tokenizer.decode(ids, skip_special_tokens=True)
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["prompt_tokens"] == len(qwen3_tokenizer.encode(prompt))
    assert meta["completion_tokens"] == 8
    assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] < meta["prompt_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["weight_version"] == "default"
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0

    logprobs = meta["output_token_logprobs"]
    assert len(logprobs) == 8
    for (lp, tok, text), want in zip(logprobs, ids):
        assert tok == want and lp <= 0.0
        assert text == qwen3_tokenizer.decode([tok])
    top = meta["output_top_logprobs"]
    assert len(top) == 8
    for row, (lp, tok, _) in zip(top, logprobs):
        assert len(row) == 3
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
        assert all(isinstance(e[2], str) for e in row)
        # greedy: the sampled token is the most likely one, with the same log-prob
        assert row[0][1] == tok and row[0][0] == pytest.approx(lp, abs=1e-5)


def test_generate_input_ids_equals_text(qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    prompt = "the quick brown fox"
    params = {**GREEDY, "max_new_tokens": 6, "ignore_eos": True}
    by_text = generate(qwen3_server, text=prompt, sampling_params=params)
    by_ids = generate(qwen3_server, input_ids=qwen3_tokenizer.encode(prompt), sampling_params=params,
                      return_logprob=True)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]
    assert "output_token_logprobs" not in by_text["meta_info"]  # only when asked for
    # without return_text_in_logprobs the text slot is None
    assert all(e[2] is None for e in by_ids["meta_info"]["output_token_logprobs"])
    assert "output_top_logprobs" not in by_ids["meta_info"]


def test_batch_of_prompts_gives_a_list(qwen3_server: ServerProcess) -> None:
    out = generate(qwen3_server, text=["one", "two two", "three three three"],
                   sampling_params=[{**GREEDY, "max_new_tokens": n, "ignore_eos": True}
                                    for n in (2, 3, 4)],
                   rid=["b-1", "b-2", "b-3"])
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["b-1", "b-2", "b-3"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 3, 4]

    ids_batch = generate(qwen3_server, input_ids=[[10, 11, 12], [20, 21]],
                         sampling_params={**GREEDY, "max_new_tokens": 3, "ignore_eos": True})
    assert [o["meta_info"]["prompt_tokens"] for o in ids_batch] == [3, 2]
    # a batch of one is still a list; each entry equals the same prompt sent alone
    one = generate(qwen3_server, input_ids=[[10, 11, 12]],
                   sampling_params={**GREEDY, "max_new_tokens": 3, "ignore_eos": True})
    assert isinstance(one, list) and one[0]["output_ids"] == ids_batch[0]["output_ids"]


def test_n_samples(qwen3_server: ServerProcess) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "n": 3,
              "sampling_seed": 1234}
    out = generate(qwen3_server, input_ids=[30, 31, 32, 33], sampling_params=params)
    assert isinstance(out, list) and len(out) == 3
    assert all(o["meta_info"]["completion_tokens"] == 12 for o in out)
    assert len({o["meta_info"]["id"] for o in out}) == 3
    assert len({tuple(o["output_ids"]) for o in out}) == 3  # independent samples
    again = generate(qwen3_server, input_ids=[30, 31, 32, 33], sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]  # seeded

    batch = generate(qwen3_server, input_ids=[[40, 41], [42, 43]],
                     sampling_params={**params, "n": 2})
    assert len(batch) == 4


def test_rid_is_echoed(qwen3_server: ServerProcess) -> None:
    out = generate(qwen3_server, input_ids=[5, 6, 7], rid="my-request-17",
                   sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["id"] == "my-request-17"


# ---- stopping --------------------------------------------------------------------------------
PROMPT = [100, 200, 300, 400, 150, 250]


def _first_new_token(ids: list[int], start: int = 2) -> int:
    """Index k >= start where ids[k] appears for the first time."""
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k])


def test_stop_token_ids_and_min_new_tokens(qwen3_server: ServerProcess) -> None:
    ref = greedy_ids(qwen3_server, PROMPT, 24)
    k = _first_new_token(ref)
    out = generate(qwen3_server, input_ids=PROMPT,
                   sampling_params={**GREEDY, "max_new_tokens": 24, "stop_token_ids": [ref[k]]})
    assert out["output_ids"] == ref[: k + 1]  # the stop token is part of the output
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[k]}

    # min_new_tokens bans the stop token until that many tokens exist
    out = generate(qwen3_server, input_ids=PROMPT,
                   sampling_params={**GREEDY, "max_new_tokens": 24, "stop_token_ids": [ref[k]],
                                    "min_new_tokens": k + 2})
    ids = out["output_ids"]
    assert ids[:k] == ref[:k] and ids[k] != ref[k]
    assert len(ids) >= k + 2
    assert ref[k] not in ids[: k + 1]


def test_stop_string_trims_text(qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    ref = greedy_ids(qwen3_server, PROMPT, 24)
    k = next(k for k in range(2, len(ref))
             if ref[k] > 6 and (s := qwen3_tokenizer.decode([ref[k]])).strip() and "\ufffd" not in s
             and s not in qwen3_tokenizer.decode(ref[:k]))
    stop = qwen3_tokenizer.decode([ref[k]])
    out = generate(qwen3_server, input_ids=PROMPT,
                   sampling_params={**GREEDY, "max_new_tokens": 24, "stop": [stop, "zzzzzz"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ref[: len(out["output_ids"])] and len(out["output_ids"]) <= k + 1
    full = qwen3_tokenizer.decode(ref[: k + 1], skip_special_tokens=True)
    assert out["text"] == full[: full.index(stop)] and stop not in out["text"]

    kept = generate(qwen3_server, input_ids=PROMPT,
                    sampling_params={**GREEDY, "max_new_tokens": 24, "stop": stop,
                                     "no_stop_trim": True})
    assert kept["text"].endswith(stop)


def test_eos_stops_unless_ignore_eos(qwen3_server: ServerProcess) -> None:
    # Near-uniform sampling over 512 tokens hits EOS (id 2) within 300 tokens in ~44% of samples;
    # with 16 seeded samples at least one does.
    params = {"temperature": 50.0, "max_new_tokens": 300, "n": 16, "sampling_seed": 7}
    stopped = generate(qwen3_server, input_ids=[9, 8, 7], sampling_params=params)
    hit = [o for o in stopped if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert hit, "no sample reached EOS"
    for o in hit:
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
        assert o["output_ids"][-1] == 2 and 2 not in o["output_ids"][:-1]

    kept = generate(qwen3_server, input_ids=[9, 8, 7], sampling_params={**params, "ignore_eos": True})
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 300} for o in kept)
    assert all(len(o["output_ids"]) == 300 for o in kept)
    assert any(2 in o["output_ids"] for o in kept)


def test_max_new_tokens(qwen3_server: ServerProcess) -> None:
    out = generate(qwen3_server, input_ids=PROMPT, sampling_params={"max_new_tokens": 5,
                                                                    "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 5 == len(out["output_ids"])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    zero = generate(qwen3_server, input_ids=PROMPT, sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


# ---- streaming -------------------------------------------------------------------------------
def test_stream_chunks_end_with_done_and_match_non_stream(qwen3_server: ServerProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 16,
                                                     "ignore_eos": True},
            "return_logprob": True}
    plain = generate(qwen3_server, **body)
    lines = []
    with httpx.stream("POST", f"{qwen3_server.url}/generate", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):  # cumulative: each chunk extends the previous one
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["output_ids"] == plain["output_ids"]
    assert last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert [e[1] for e in last["meta_info"]["output_token_logprobs"]] == plain["output_ids"]


# ---- abort, flush --------------------------------------------------------------------------
LONG = {"max_new_tokens": 1900, "ignore_eos": True}
# How long a request may take to reach the engine, or an abort to end it. Idle it is well under a
# second; a loaded CI machine (load 4-8 on 2 cores) was seen 30x slower, so the waits below poll a
# condition with this generous limit instead of assuming a fixed delay.
SETTLE_S = 180.0


async def _wait_running(client: httpx.AsyncClient, n: int, timeout: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = (await client.get("/get_server_info")).json()
        if info["num_running_reqs"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {n} requests started running")


def test_abort_request_ends_a_running_request(qwen3_server: ServerProcess) -> None:
    async def main() -> tuple[dict, list]:
        async with httpx.AsyncClient(base_url=qwen3_server.url, timeout=60) as c:
            one = asyncio.create_task(c.post("/generate", json={
                "input_ids": [1, 2, 3], "rid": "long-one", "sampling_params": LONG}))
            # n=2 gets rids long-two-0 and long-two-1; aborting "long-two" reaches both (SGLang)
            two = asyncio.create_task(c.post("/generate", json={
                "input_ids": [4, 5, 6], "rid": "long-two", "sampling_params": {**LONG, "n": 2}}))
            try:
                await _wait_running(c, 3)
            finally:
                for rid in ("long-one", "long-two"):
                    r = await c.post("/abort_request", json={"rid": rid})
                    assert r.status_code == 200
            return (await one).json(), (await two).json()

    one, two = asyncio.run(main())
    for out in [one, *two]:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] == len(out["output_ids"]) < LONG["max_new_tokens"]
    assert one["meta_info"]["id"] == "long-one"
    assert server_info(qwen3_server)["num_running_reqs"] == 0


def test_flush_cache_refused_while_a_request_runs(qwen3_server: ServerProcess) -> None:
    assert httpx.post(f"{qwen3_server.url}/flush_cache", timeout=10).status_code == 200

    async def main() -> tuple[httpx.Response, dict]:
        async with httpx.AsyncClient(base_url=qwen3_server.url, timeout=60) as c:
            task = asyncio.create_task(c.post("/generate", json={
                "input_ids": [7, 8, 9], "rid": "flush-blocker", "sampling_params": LONG}))
            try:
                await _wait_running(c, 1)
                busy = await c.post("/flush_cache")
            finally:
                await c.post("/abort_request", json={"rid": "flush-blocker"})
            return busy, (await task).json()

    busy, out = asyncio.run(main())
    assert busy.status_code == 400
    assert "running" in busy.json()["error"]["message"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert httpx.post(f"{qwen3_server.url}/flush_cache", timeout=10).status_code == 200


def test_client_that_goes_away_frees_its_requests(qwen3_server: ServerProcess) -> None:
    """A rollout client that times out must not leave the engine generating for nobody."""
    url = qwen3_server.url

    def aborted() -> float:
        return metrics(qwen3_server)["milepost:requests_aborted_total"]

    def wait_aborted(count: float) -> None:
        """Until `count` requests were aborted and none runs. Under load the server may read the
        request only after the client gave up (it then submits and aborts it), and it notices a
        gone client within DISCONNECT_POLL_S of its loop's time: wait for the outcome, not a delay."""
        deadline = time.monotonic() + SETTLE_S
        while aborted() - start < count or server_info(qwen3_server)["num_running_reqs"]:
            assert time.monotonic() < deadline, (
                f"{aborted() - start} of {count} requests aborted, "
                f"{server_info(qwen3_server)['num_running_reqs']} running after {SETTLE_S} s")
            time.sleep(0.05)

    start = aborted()
    with pytest.raises(httpx.TimeoutException):  # non-streaming, n=4
        httpx.post(f"{url}/generate", timeout=0.3,
                   json={"input_ids": [1, 2, 3], "sampling_params": {**LONG, "n": 4}})
    wait_aborted(4)
    assert server_info(qwen3_server)["num_running_reqs"] == 0
    assert aborted() - start == 4

    with httpx.stream("POST", f"{url}/generate", timeout=30, json={
            "input_ids": [1, 2, 3], "sampling_params": LONG, "stream": True}) as r:
        next(r.iter_lines())  # one chunk, then hang up
    wait_aborted(5)
    assert server_info(qwen3_server)["num_running_reqs"] == 0
    assert aborted() - start == 5


# ---- info, health, metrics -----------------------------------------------------------------
def test_health_and_info_endpoints(qwen3_server: ServerProcess, qwen3_dir) -> None:
    url = qwen3_server.url
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    model = httpx.get(f"{url}/get_model_info", timeout=10).json()
    assert model["model_path"] == str(qwen3_dir)
    assert model["is_generation"] is True
    assert model["context_length"] == 2048 and model["vocab_size"] == 512
    info = server_info(qwen3_server)
    assert info["max_total_tokens"] == 32768 and info["page_size"] == 16
    assert info["weight_version"] == "default" and info["paused"] is None
    assert httpx.get(f"{url}/get_weight_version", timeout=10).json() == {"weight_version": "default"}


def test_metrics_in_prometheus_format(qwen3_server: ServerProcess) -> None:
    prompt = list(range(60, 100))  # 40 tokens: two full pages the second request reuses
    before = metrics(qwen3_server)
    for _ in range(2):
        generate(qwen3_server, input_ids=prompt, sampling_params={"max_new_tokens": 4,
                                                                  "ignore_eos": True})
    m = metrics(qwen3_server)
    for name in ("milepost:num_running_reqs", "milepost:num_queue_reqs", "milepost:token_usage",
                 "milepost:gen_throughput", "milepost:cache_hit_rate", "milepost:num_preemptions"):
        assert name in m, f"{name} missing from /metrics"
    assert m["milepost:num_running_reqs"] == 0 and m["milepost:num_queue_reqs"] == 0
    assert m["milepost:token_usage"] == 0.0  # idle: cached prefixes are evictable, not in use
    assert m["milepost:max_total_num_tokens"] == 32768
    assert 0.0 < m["milepost:cache_hit_rate"] <= 1.0
    assert m["milepost:gen_throughput"] >= 0.0
    assert m["milepost:generation_tokens_total"] - before["milepost:generation_tokens_total"] >= 8
    assert m["milepost:prompt_tokens_total"] - before["milepost:prompt_tokens_total"] == 80
    assert m["milepost:cached_tokens_total"] - before["milepost:cached_tokens_total"] >= 32


def test_prefix_cache_reports_cached_tokens(qwen3_server: ServerProcess) -> None:
    page = server_info(qwen3_server)["page_size"]
    prompt = [int(t) for t in np.random.default_rng(11).integers(7, 512, size=45)]
    first = generate(qwen3_server, input_ids=prompt, sampling_params={"max_new_tokens": 3})
    assert first["meta_info"]["cached_tokens"] == 0
    second = generate(qwen3_server, input_ids=prompt + [8, 9, 10, 11, 12],
                      sampling_params={"max_new_tokens": 3})
    meta = second["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) + 5
    assert len(prompt) - page <= meta["cached_tokens"] < meta["prompt_tokens"]


# ---- OpenAI-compatible routes ----------------------------------------------------------------
def test_v1_completions(qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    prompt = "once upon a time"
    r = httpx.post(f"{qwen3_server.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                         "user": "ignored-extra-field"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    n_prompt = len(qwen3_tokenizer.encode(prompt))
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["total_tokens"] == n_prompt + out["usage"]["completion_tokens"]
    ref = generate(qwen3_server, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 6})
    assert out["choices"][0]["text"] == ref["text"]
    assert out["choices"][0]["finish_reason"] == (
        "length" if ref["meta_info"]["finish_reason"]["type"] == "length" else "stop")


def test_v1_completions_batch_of_prompts(qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    prompts = ["alpha beta", "gamma"]
    r = httpx.post(f"{qwen3_server.url}/v1/completions", timeout=60,
                   json={"prompt": prompts, "max_tokens": 4, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]  # prompt-major, then samples
    for i, prompt in enumerate(prompts):
        ref = generate(qwen3_server, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 4})
        assert out["choices"][2 * i]["text"] == out["choices"][2 * i + 1]["text"] == ref["text"]
    assert out["usage"]["prompt_tokens"] == sum(len(qwen3_tokenizer.encode(p)) for p in prompts)


def test_v1_chat_completions_use_the_chat_template(qwen3_server: ServerProcess,
                                                   qwen3_tokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hi."}]
    r = httpx.post(f"{qwen3_server.url}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 5, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    ids = qwen3_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    assert out["usage"]["prompt_tokens"] == len(ids)
    ref = generate(qwen3_server, input_ids=list(ids),
                   sampling_params={**GREEDY, "max_new_tokens": 5})
    assert len(out["choices"]) == 2
    for i, choice in enumerate(out["choices"]):
        assert choice["index"] == i
        assert choice["message"] == {"role": "assistant", "content": ref["text"]}


# ---- every architecture serves ---------------------------------------------------------------
@pytest.mark.parametrize("server", ["llama_server", "moe_server"])
def test_other_architectures_generate(server: str, request: pytest.FixtureRequest) -> None:
    srv: ServerProcess = request.getfixturevalue(server)
    prompt = [11, 12, 13, 14, 15]
    out = generate(srv, input_ids=prompt, return_logprob=True, return_routed_experts=True,
                   sampling_params={**GREEDY, "max_new_tokens": 6, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 6
    assert [e[1] for e in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    if server != "moe_server":
        assert "routed_experts" not in out["meta_info"]
        return
    # SGLang's format: base64 of int32 (prompt + completion - 1, layers, top_k)
    experts = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    layers, top_k, n_experts = 2, 2, 8
    assert experts.size == (len(prompt) + 6 - 1) * layers * top_k
    experts = experts.reshape(-1, layers, top_k)
    assert ((experts >= 0) & (experts < n_experts)).all()
    assert (experts[:, :, 0] != experts[:, :, 1]).all()  # top-k picks distinct experts
