"""Pause modes of a real `milepost serve` process, over HTTP, with requests in flight.

abort: in-flight requests end with finish_reason abort. retract: their KV is dropped, and after a
weight update and /continue_generation they finish, the tokens after the update being what greedy
decoding with the new weights gives from that prefix. in_place: they resume with their KV kept
and lose no token. The tiny model decodes ~2000 tokens/s here, so in-flight requests are long
(1900 tokens) and streamed, and the tests act once the first tokens have arrived. Last, in
process: a crashed engine loop still answers every caller (abort / error), never leaves one waiting.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess

CHUNK = 8  # --chunked-prefill-size
# Tokens of an in-flight request: ~1 s of streamed decoding idle, room to act meanwhile (1000 left
# ~0.5 s, which a descheduled test process on a loaded machine can miss); prompt + LONG < 2048.
LONG = 1900
# How long a request may take to start, end, or reach a state; idle it is well under a second, a
# loaded CI machine was seen 30x slower. Waits poll a condition with this limit, never a delay.
SETTLE_S = 180.0
PROMPT = [7, 300, 21, 5, 99, 140, 3, 250, 61, 17]
ARGMAX_TOL = 1e-4  # a token counts as greedy if its logit is within this of the maximum


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pause")
    return {"a": make_tiny_checkpoint(root / "a", "qwen3", seed=0, with_tokenizer=False),
            "b": make_tiny_checkpoint(root / "b", "qwen3", seed=1, with_tokenizer=False)}


@pytest.fixture(scope="module")
def server(ckpts: dict[str, Path]):
    with ServerProcess(ckpts["a"], "--page-size", "4", "--chunked-prefill-size", str(CHUNK),
                       "--max-total-tokens", "8192", "--weight-version", "a0") as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        c.post("/continue_generation")  # never leave the next test a paused server


class Stream:
    """A streamed /generate running in a thread; `chunks` are the parsed events so far."""

    def __init__(self, url: str, prompt: list[int], max_new_tokens: int = LONG) -> None:
        self.body = {"input_ids": prompt, "stream": True,
                     "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                         "ignore_eos": True}}
        self.url = url
        self.chunks: list[dict] = []
        self.started = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{self.url}/generate",
                                                        json=self.body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.chunks.append(json.loads(line[len("data: "):]))
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self.error = e
            self.started.set()

    def wait_started(self) -> None:
        assert self.started.wait(SETTLE_S), f"no streamed token within {SETTLE_S} s"
        assert self.error is None, self.error

    @property
    def n_tokens(self) -> int:
        return len(self.chunks[-1]["output_ids"]) if self.chunks else 0

    def result(self) -> dict:
        self._thread.join(SETTLE_S)
        assert not self._thread.is_alive(), "stream did not finish"
        assert self.error is None, self.error
        return self.chunks[-1]


def server_info(c: httpx.Client) -> dict:
    return c.get("/get_server_info").json()


def wait_queued(c: httpx.Client, n: int) -> None:
    """Until `n` requests wait in the queue (a request sent from a thread reaches the server after
    an unknown delay on a loaded machine)."""
    deadline = time.monotonic() + SETTLE_S
    while (queued := server_info(c)["num_queue_reqs"]) != n:
        assert time.monotonic() < deadline, f"{queued} requests queued, not {n}, after {SETTLE_S} s"
        time.sleep(0.05)


def forward_steps(c: httpx.Client) -> int:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("milepost:forward_steps_total"):
            return int(float(line.split()[-1]))
    raise AssertionError("metrics lack milepost:forward_steps_total")


def generate(c: httpx.Client, prompt: list[int], n: int) -> dict:
    r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def pause(c: httpx.Client, mode: str) -> None:
    r = c.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200, r.text


def load_disk(c: httpx.Client, path: Path, version: str, **kw: object) -> None:
    r = c.post("/update_weights_from_disk",
               json={"model_path": str(path), "weight_version": version, **kw})
    assert r.status_code == 200, r.text


def assert_greedy(hf: torch.nn.Module, seq: list[int], positions: range, what: str) -> None:
    """seq[p] is the greedy pick of `hf` given seq[:p], for every p in positions."""
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].float()
    rows = logits[positions.start - 1 : positions.stop - 1]
    picked = rows.gather(1, torch.tensor(seq[positions.start : positions.stop])[:, None])[:, 0]
    gap = rows.max(-1).values - picked
    bad = (gap > ARGMAX_TOL).nonzero()
    assert bad.numel() == 0, f"{what}: token {positions.start + int(bad[0])} is not greedy"


def test_abort_ends_in_flight_and_holds_new_requests(client: httpx.Client, server) -> None:
    streams = [Stream(server.url, PROMPT), Stream(server.url, PROMPT[:3])]
    for s in streams:
        s.wait_started()
    pause(client, "abort")
    for s in streams:
        out = s.result()
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < LONG
    assert server_info(client)["num_running_reqs"] == 0

    held = Stream(server.url, PROMPT, max_new_tokens=5)  # arrives while paused: waits, not aborted
    wait_queued(client, 1)
    assert not held.chunks and server_info(client)["num_running_reqs"] == 0
    client.post("/continue_generation").raise_for_status()
    out = held.result()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_retract_update_continue_uses_new_weights(client: httpx.Client, server, ckpts) -> None:
    load_disk(client, ckpts["a"], "a1")
    s = Stream(server.url, PROMPT)
    s.wait_started()
    pause(client, "retract")
    info = server_info(client)
    assert (info["num_running_reqs"], info["num_queue_reqs"]) == (0, 1), "retract requeues"
    load_disk(client, ckpts["b"], "b1")
    assert client.get("/get_weight_version").json() == {"weight_version": "b1"}
    client.post("/continue_generation").raise_for_status()

    out = s.result()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": LONG}
    versions = meta["output_token_weight_versions"]
    k = versions.count("a1")
    assert 0 < k < LONG and versions == ["a1"] * k + ["b1"] * (LONG - k)
    assert meta["weight_version"] == "b1"

    seq = PROMPT + out["output_ids"]
    n = len(PROMPT)
    hf_a = AutoModelForCausalLM.from_pretrained(ckpts["a"], dtype=torch.float32).eval()
    hf_b = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32).eval()
    assert_greedy(hf_a, seq[: n + k], range(n, n + k), "before the update (weights a)")
    # Retract dropped the KV: the prefix was recomputed with b, so b's full forward must agree.
    assert_greedy(hf_b, seq, range(n + k, len(seq)), "after the update (weights b)")


def test_in_place_keeps_kv_and_loses_no_token(client: httpx.Client, server, ckpts) -> None:
    load_disk(client, ckpts["a"], "a2")
    reference = generate(client, PROMPT, LONG)["output_ids"]
    client.post("/flush_cache").raise_for_status()  # so the paused request computes its own KV
    steps_before = forward_steps(client)

    s = Stream(server.url, PROMPT)
    s.wait_started()
    pause(client, "in_place")
    info = server_info(client)
    assert (info["num_running_reqs"], info["num_queue_reqs"]) == (1, 0), "in_place keeps it running"
    # Tokens made before the pause may still be on their way (for long on a loaded machine): wait
    # until the stream holds every token the engine's steps made (prefill chunks, then one a step).
    prefill = math.ceil(len(PROMPT) / CHUNK)
    deadline = time.monotonic() + SETTLE_S
    while s.n_tokens != (made := forward_steps(client) - steps_before - prefill + 1):
        assert time.monotonic() < deadline, f"streamed {s.n_tokens} of {made} tokens in {SETTLE_S} s"
        time.sleep(0.05)
    frozen, steps = s.n_tokens, forward_steps(client)
    time.sleep(0.3)  # a window to catch a step or token while paused (none may come)
    assert s.n_tokens == frozen < LONG, "no token may be generated while paused"
    assert forward_steps(client) == steps, "the engine stepped while paused"
    client.post("/continue_generation").raise_for_status()

    out = s.result()
    assert out["output_ids"] == reference
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    # KV kept: exactly the steps of an uninterrupted run (prefill chunks, then one per token).
    assert forward_steps(client) - steps_before == math.ceil(len(PROMPT) / CHUNK) + LONG - 1


def test_abort_all_update_keeps_a_paused_server_paused(client: httpx.Client, server, ckpts) -> None:
    """An update with abort_all_requests must not end the pause the trainer asked for."""
    s = Stream(server.url, PROMPT)
    s.wait_started()
    pause(client, "in_place")
    load_disk(client, ckpts["a"], "a3", abort_all_requests=True)
    assert s.result()["meta_info"]["finish_reason"]["type"] == "abort"

    held = Stream(server.url, PROMPT, max_new_tokens=5)
    wait_queued(client, 1)
    assert not held.chunks, "the server generated while paused"
    assert server_info(client)["paused"] == "in_place"
    client.post("/continue_generation").raise_for_status()
    out = held.result()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["output_token_weight_versions"] == ["a3"] * 5


def test_a_crashed_loop_answers_every_caller(ckpts) -> None:
    """In-process: after the loop crashes, in-flight and new requests end (abort), calls fail,
    nobody waits forever."""
    engine = build_engine(ServerArgs(model_path=ckpts["a"], device="cpu", page_size=4,
                                     max_total_tokens=256).resolved())[0]
    forward = engine.runner.forward
    calls = []

    def failing_forward(chunks, feed=None):  # noqa: ANN001, ANN202 - the third step fails
        calls.append(len(chunks))
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return forward(chunks, feed)

    engine.runner.forward = failing_forward

    def submit(rid: str) -> Future:
        done: Future = Future()
        got: list[int] = []

        def on_output(o) -> None:  # noqa: ANN001
            got.extend(o.new_token_ids)
            if o.finished:
                done.set_result((got, o.finish_reason))

        engine.submit(Request(rid=rid, prompt_ids=PROMPT, on_output=on_output, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=50, ignore_eos=True)))
        return done

    engine.start()
    try:
        tokens, reason = submit("before").result(timeout=30)
        assert reason["type"] == "abort" and "injected failure" in reason["message"]
        assert len(tokens) == 2, "tokens sampled before the crash are still delivered"
        assert isinstance(engine.error, RuntimeError)
        tokens, reason = submit("after").result(timeout=30)
        assert tokens == [] and reason["type"] == "abort"
        with pytest.raises(RuntimeError, match="crashed"):
            engine.call(lambda: None).result(timeout=30)
    finally:
        engine.close()
    assert not engine._thread.is_alive()
