"""OpenAI fields through the session server against a real engine: sampling fields reach the
engine under SGLang's names, `logprobs: true` returns the engine's log-probs per sampled token, and
`chat_template_kwargs` reaches the template (Qwen3's enable_thinking=false pre-fills an empty think
block) while the session stays token-exact across turns."""

from __future__ import annotations

import httpx
import pytest

from milepost.session.runner import SessionServerThread
from milepost.testing.agent_harness import RecordingTransport
from milepost.testing.server_process import ServerProcess


@pytest.fixture(scope="module")
def engine(agent_engine: ServerProcess) -> ServerProcess:
    return agent_engine  # one engine for every session test (tests/e2e/conftest.py)


def test_sampling_fields_logprobs_and_template_kwargs(agent_dir, engine) -> None:
    from transformers import AutoTokenizer

    from milepost.testing.chat_templates import QWEN3

    tok = AutoTokenizer.from_pretrained(agent_dir)
    tok.chat_template = QWEN3  # the published template reads enable_thinking
    rec = RecordingTransport()
    with SessionServerThread(tok, engine.url, family="qwen3", engine_transport=rec) as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as c:
        sid = c.post("/sessions").json()["session_id"]
        url = f"/sessions/{sid}/v1/chat/completions"
        messages = [{"role": "user", "content": "Hello there"}]
        r = c.post(url, json={"messages": messages, "max_completion_tokens": 64, "top_k": 5,
                              "seed": 7, "temperature": 0, "logprobs": True,
                              "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        body = r.json()
        sent, answer, _ = rec.generate_calls[-1]
        params = sent["sampling_params"]
        assert (params["top_k"], params["sampling_seed"], params["max_new_tokens"]) == (5, 7, 64)
        lps = body["choices"][0]["logprobs"]["content"]
        assert [e["logprob"] for e in lps] == [e[0] for e in
                                               answer["meta_info"]["output_token_logprobs"]]
        assert "".join(e["token"] for e in lps) == tok.decode(answer["output_ids"])
        # enable_thinking=false: the prompt ends with the empty think block the template adds.
        empty_think = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
        assert sent["input_ids"][-len(empty_think):] == empty_think
        messages += [body["choices"][0]["message"], {"role": "user", "content": "Thanks!"}]
        r = c.post(url, json={"messages": messages, "max_tokens": 64, "temperature": 0,
                              "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        (sample,) = c.post(f"/sessions/{sid}/samples").json()["samples"]
    (first_in, first_out), (second_in, second_out) = [
        (req["input_ids"], out["output_ids"]) for req, out, _ in rec.generate_calls]
    assert second_in[:len(first_in) + len(first_out)] == first_in + first_out
    assert sample["tokens"] == second_in + second_out
