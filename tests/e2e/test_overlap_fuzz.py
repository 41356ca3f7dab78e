"""The overlap schedule under random traffic (tiny checkpoint, fp32, CPU, driven step by step):
arrivals between steps, a queue past max_running, a pool small enough to preempt, long prompts
in chunks, stop tokens, penalties (counted from the tokens the queued step applied), prompt
log-probs, requests for one token, aborts. Every request's tokens and log-probs equal those of the
same traffic without the overlap schedule; aborted requests got a prefix of them; no block leaks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("overlap_fuzz") / "qwen3", "qwen3", seed=4,
                                with_tokenizer=False)


def traffic(seed: int) -> list[tuple[int, dict]]:
    """(step to arrive at, request fields) for 24 requests; a few are aborted later."""
    rng = random.Random(seed)
    out = []
    for i in range(24):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 3, 9, 17, 33, 41]))]
        params = dict(max_new_tokens=rng.choice([1, 2, 7, 12, 20]), temperature=0.0, ignore_eos=True)
        if rng.random() < 0.2:
            params["repetition_penalty"] = 1.3
        kw: dict = {"prompt_ids": prompt, "params": SamplingParams(**params), "return_logprob": True,
                    "stop_ids": frozenset()}
        if rng.random() < 0.25:
            kw["stop_ids"] = frozenset(rng.sample(range(3, VOCAB), 40))
        if rng.random() < 0.15 and len(prompt) > 2:
            kw["logprob_start_len"] = 1
        out.append((rng.randrange(0, 30), kw))
    return sorted(out, key=lambda x: x[0])


def drive(ckpt: Path, seed: int, overlap: str) -> tuple[dict, dict, list[int], int]:
    args = ServerArgs(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=16, max_total_tokens=72, max_running_requests=5,
                      overlap_schedule=overlap).resolved()
    engine = build_engine(args)[0]
    fed = [0, 0]  # forwards launched ahead with prompt chunks / with penalized rows in them
    forward = engine.runner.forward

    def counting(chunks, feed=None):  # noqa: ANN001, ANN202
        if feed is not None:
            fed[0] += any(c.length > 1 for c in chunks)
            fed[1] += any(c.req.penalized for c in chunks)
        return forward(chunks, feed)

    engine.runner.forward = counting
    got: dict[str, tuple[list[int], list[float], dict | None]] = {}
    aborts = {f"r{i}": 12 + i for i in (3, 11, 19)}  # rid -> step to abort at

    def on_output(rid: str):
        def put(o) -> None:  # noqa: ANN001
            toks, lps, _ = got[rid]
            got[rid] = (toks + list(o.new_token_ids), lps + list(o.new_logprobs),
                        o.finish_reason if o.finished else None)
        return put

    plan = traffic(seed)
    step, i = 0, 0
    while i < len(plan) or engine.scheduler.has_work:
        while i < len(plan) and plan[i][0] <= step:
            rid = f"r{i}"
            got[rid] = ([], [], None)
            engine.submit(Request(rid=rid, on_output=on_output(rid), **plan[i][1]))
            i += 1
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)
        engine._drain_inbox(block=False)
        engine.step()
        step += 1
        assert step < 2000, "the engine did not finish the traffic"
    engine._flush()
    leaked = engine.pool.num_used - (engine.cache.num_cached_blocks if engine.cache else 0)
    assert leaked == 0, f"{leaked} blocks leaked"
    return got, aborts, fed, engine.scheduler.num_preemptions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_schedule_under_random_traffic_equals_no_overlap(ckpt, seed) -> None:
    on, aborts, fed, preempted = drive(ckpt, seed, "on")
    off, _, none, _ = drive(ckpt, seed, "off")
    assert fed[0] > 0 and none == [0, 0], "no mixed step was launched ahead"
    assert fed[1] > 0, "no step with a penalized row was launched ahead"
    assert preempted > 0, "the pool was meant to be small enough to preempt"
    for rid, (toks, lps, reason) in off.items():
        got_toks, got_lps, got_reason = on[rid]
        if rid in aborts and (reason or {}).get("type") == "abort" or \
                (got_reason or {}).get("type") == "abort":
            assert got_toks == toks[: len(got_toks)] or toks == got_toks[: len(toks)], rid
            continue
        assert got_toks == toks, (seed, rid)
        assert got_lps == pytest.approx(lps, abs=1e-5), (seed, rid)
        assert got_reason == reason, (seed, rid)
