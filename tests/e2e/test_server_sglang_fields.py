"""SGLang's fields beyond the core /generate path, against a real `milepost serve` process.

Prompt log-probs are checked against a full forward of the same checkpoint in transformers (fp32
CPU, <= 1e-5), with and without prefix-cache hits; penalties, bias, streaming of batches, the load
and info endpoints, and requests shaped as slime and sglang-router send them.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from milepost.testing.server_process import ServerProcess

GREEDY = {"temperature": 0.0}


def flush(srv: ServerProcess) -> None:
    assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200


def post(srv: ServerProcess, path: str, body: dict) -> dict | list:
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def hf_logprobs(qwen3_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1]: log p(ids[i] | ids[:i]) for i >= 1, from one full forward."""
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)

    return run


def test_prompt_logprobs_equal_a_full_forward_with_and_without_cache(
        qwen3_server: ServerProcess, hf_logprobs) -> None:
    prompt = [(7 * i + 3) % 500 for i in range(70)]  # crosses several 16-token KV blocks
    want = hf_logprobs(prompt)
    flush(qwen3_server)
    # As slime scores a sequence with a teacher: max_new_tokens 0, logprob_start_len 0.
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {**GREEDY, "max_new_tokens": 0}}
    cold = post(qwen3_server, "/generate", body)
    warm = post(qwen3_server, "/generate", body)  # the whole prompt is now in the prefix cache
    for out in (cold, warm):
        entries = out["meta_info"]["input_token_logprobs"]
        assert len(entries) == len(prompt) and entries[0] == [None, prompt[0], None]
        assert [e[1] for e in entries] == prompt
        got = torch.tensor([e[0] for e in entries[1:]])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert warm["meta_info"]["cached_tokens"] == 0, "scored positions are recomputed, not cached"

    # From position 40, after a cached 64-token prefix: positions before 39 may come from cache.
    tail = post(qwen3_server, "/generate", {**body, "logprob_start_len": 40})
    entries = tail["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[40:]
    torch.testing.assert_close(torch.tensor([e[0] for e in entries]), want[39:], atol=1e-5, rtol=0)
    assert tail["meta_info"]["cached_tokens"] > 0


def test_prompt_top_logprobs_and_token_ids_logprob(qwen3_server: ServerProcess, hf_logprobs) -> None:
    prompt = [5, 9, 14, 200, 31, 77]
    ids = [3, 200, 31]
    out = post(qwen3_server, "/generate", {
        "input_ids": prompt, "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2,
        "token_ids_logprob": ids, "sampling_params": {**GREEDY, "max_new_tokens": 3,
                                                      "ignore_eos": True}})
    meta = out["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[2:]
    assert len(meta["input_top_logprobs"]) == 4 and all(len(r) == 2 for r in meta["input_top_logprobs"])
    for row, entry in zip(meta["input_token_ids_logprobs"], meta["input_token_logprobs"]):
        assert [e[1] for e in row] == ids
        by_id = {e[1]: e[0] for e in row}
        if entry[1] in by_id:
            assert by_id[entry[1]] == pytest.approx(entry[0], abs=1e-6)
    outs = meta["output_token_ids_logprobs"]
    assert len(outs) == 3 and all([e[1] for e in row] == ids for row in outs)
    # the prompt tail and the output continue one sequence: compare with one full forward
    full = prompt + out["output_ids"]
    want = hf_logprobs(full)
    got = [e[0] for e in meta["input_token_logprobs"]] + [e[0] for e in meta["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(got), want[1:], atol=1e-5, rtol=0)


def test_default_logprob_start_returns_no_prompt_logprobs(qwen3_server: ServerProcess) -> None:
    out = post(qwen3_server, "/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 2,
                                                               "ignore_eos": True}})
    assert out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == 2


def test_frequency_penalty_changes_a_repetitive_greedy_output(qwen3_server: ServerProcess) -> None:
    base = {"input_ids": [11, 12, 13], "sampling_params": {**GREEDY, "max_new_tokens": 40,
                                                           "ignore_eos": True}}
    plain = post(qwen3_server, "/generate", base)["output_ids"]
    assert len(set(plain)) < len(plain), "the tiny model repeats itself greedily"
    pen = post(qwen3_server, "/generate", {**base, "sampling_params": {
        **base["sampling_params"], "frequency_penalty": 2.0, "presence_penalty": 2.0}})["output_ids"]
    assert pen != plain
    assert len(set(pen)) > len(set(plain))
    # the same request twice: penalties are deterministic
    again = post(qwen3_server, "/generate", {**base, "sampling_params": {
        **base["sampling_params"], "frequency_penalty": 2.0, "presence_penalty": 2.0}})["output_ids"]
    assert again == pen


def test_logit_bias_forces_a_token(qwen3_server: ServerProcess) -> None:
    out = post(qwen3_server, "/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 5, "ignore_eos": True, "logit_bias": {"123": 1000.0}}})
    assert out["output_ids"] == [123] * 5


def test_stop_token_text_is_trimmed(qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    first = post(qwen3_server, "/generate", {"input_ids": [4, 5, 6], "sampling_params": {
        **GREEDY, "max_new_tokens": 6, "ignore_eos": True}})["output_ids"]
    stop = first[2]
    out = post(qwen3_server, "/generate", {"input_ids": [4, 5, 6], "sampling_params": {
        **GREEDY, "max_new_tokens": 6, "ignore_eos": True, "stop_token_ids": [stop]}})
    k = first.index(stop)
    assert out["output_ids"] == first[: k + 1]
    assert out["text"] == qwen3_tokenizer.decode(first[:k], skip_special_tokens=True)


def test_slime_and_router_shaped_requests(qwen3_server: ServerProcess) -> None:
    """Fields slime and sglang-router send, at their usual values, with null for defaults."""
    out = post(qwen3_server, "/generate", {
        "input_ids": [1, 2, 3], "return_logprob": True, "rid": None, "stream": False,
        "sampling_params": {"temperature": 1.0, "top_p": 0.9, "top_k": None, "max_new_tokens": 4,
                            "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                            "no_stop_trim": True, "spaces_between_special_tokens": False,
                            "custom_params": {"max_top_p": 0.9}, "frequency_penalty": 0.0,
                            "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
                            "json_schema": None, "regex": None, "ebnf": None, "stream_interval": None,
                            "sampling_seed": 5, "ignore_eos": True},
        "model": "default", "log_metrics": True, "no_logs": False, "return_hidden_states": False,
        "return_entropy": False, "return_bytes": False, "background": False, "session_id": "s1",
        "routing_key": "rk", "priority": 0, "extra_key": None, "lora_path": None,
        "data_parallel_rank": None, "routed_dp_rank": 0, "return_prompt_token_ids": True,
        "image_data": None, "custom_labels": {"team": "rl"}})
    assert len(out["output_ids"]) == 4 and out["prompt_token_ids"] == [1, 2, 3]


def test_batch_with_one_rid_derives_one_per_prompt(qwen3_server: ServerProcess) -> None:
    outs = post(qwen3_server, "/generate", {"input_ids": [[1], [2]], "rid": "job",
                                            "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in outs] == ["job_0", "job_1"]


def test_extra_key_neither_reads_nor_fills_the_cache(qwen3_server: ServerProcess) -> None:
    prompt = list(range(100, 148))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    flush(qwen3_server)
    salted = post(qwen3_server, "/generate", {**body, "extra_key": "tenant-a"})
    assert salted["meta_info"]["cached_tokens"] == 0
    plain = post(qwen3_server, "/generate", body)
    assert plain["meta_info"]["cached_tokens"] == 0, "a salted request left its prefix behind"
    again = post(qwen3_server, "/generate", {**body, "extra_key": "tenant-a"})
    assert again["meta_info"]["cached_tokens"] == 0
    assert post(qwen3_server, "/generate", body)["meta_info"]["cached_tokens"] > 0


def _sse(srv: ServerProcess, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_streaming_a_batch_with_n_and_stream_interval(qwen3_server: ServerProcess) -> None:
    chunks = _sse(qwen3_server, {"input_ids": [[1, 2], [3, 4]], "stream": True, "sampling_params": {
        "max_new_tokens": 6, "ignore_eos": True, "n": 2, "stream_interval": 3}})
    finals = {}
    for c in chunks:
        assert c["index"] in range(4)
        finals[c["index"]] = c
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(len(c["output_ids"]) == 6 for c in finals.values())
    # stream_interval 3: each sequence sends at 3 and 6 tokens (the last with the finish reason)
    per = {i: [len(c["output_ids"]) for c in chunks if c["index"] == i] for i in range(4)}
    assert all(v == [3, 6] for v in per.values()), per


def test_incremental_streaming_output(start_server, qwen3_dir: Path) -> None:
    srv = start_server(qwen3_dir, "--max-total-tokens", "4096", "--incremental-streaming-output")
    body = {"input_ids": [1, 2, 3], "sampling_params": {**GREEDY, "max_new_tokens": 5,
                                                        "ignore_eos": True}}
    whole = post(srv, "/generate", body)
    chunks = _sse(srv, {**body, "stream": True, "return_logprob": True})
    assert [len(c["output_ids"]) for c in chunks] == [1] * 5
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert all(len(c["meta_info"]["output_token_logprobs"]) == 1 for c in chunks)


def test_load_and_info_endpoints(qwen3_server: ServerProcess, qwen3_tokenizer) -> None:
    url = qwen3_server.url
    load = httpx.get(f"{url}/get_load", timeout=10).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    loads = httpx.get(f"{url}/v1/loads", timeout=10).json()
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["num_running_reqs"] == 0
    assert loads["loads"][0]["max_total_num_tokens"] == 32768
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(f"{url}{path}", timeout=10).json()["vocab_size"] == 512
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    assert info["dp_size"] == 1 and "num_running_reqs" in info
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert models["data"][0]["max_model_len"] == 2048
    tok = post(qwen3_server, "/tokenize", {"prompt": "hello world"})
    assert tok["tokens"] == qwen3_tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    text = post(qwen3_server, "/detokenize", {"tokens": tok["tokens"]})["text"]
    assert text == qwen3_tokenizer.decode(tok["tokens"])
    r = httpx.post(f"{url}/detokenize", json={"tokens": [9999]}, timeout=10)
    assert r.status_code == 400 and "9999" in r.json()["error"]["message"]
    w = post(qwen3_server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})
    assert len(w) == 4 and all(isinstance(x, float) for x in w)
    r = httpx.post(f"{url}/get_weights_by_name", json={"name": "no.such"}, timeout=10)
    assert r.status_code == 400
