"""Served distillation teacher against real `milepost serve` processes (report 5.2).

The teacher is the student's own checkpoint, so every reverse-KL estimate must vanish; the
in-process teacher (the same checkpoint in a trainer rank) must give the served teacher's
log-probs and the same advantages. Bad teachers (wrong tokenizer, unreachable, wrong lengths,
failing) are refused at start or give the group up whole, counted.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from milepost.data.source import PromptItem
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import SamplingSettings, generate_one, rollout_groups
from milepost.rollout.teacher import PROBE, ServedTeachers, TeacherError, TeacherSettings
from milepost.testing.dist import run_ranks
from milepost.train.advantages import AdvantageSettings, estimate
from milepost.train.distill import TOPK_KEY, apply_opd, sample_signal
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Group

SAMPLING = SamplingSettings(temperature=1.0, max_new_tokens=6)


def _items() -> list[PromptItem]:
    return [PromptItem(index=k, prompt="", prompt_ids=[(7 * i + 3 * k) % 400 + 5 for i in range(9)],
                       metadata={"teacher": "math" if k == 0 else "code"}) for k in range(2)]


async def _groups(url: str, top_k: int) -> list[Group]:
    async with EngineClient(url) as c:
        return [[await generate_one(c, it, SAMPLING, j, group_index=it.index, top_logprobs_num=top_k)
                 for j in range(2)] for it in _items()]


def _score(teachers: ServedTeachers, groups: list[Group]) -> list[str | None]:
    async def run() -> list[str | None]:
        return [await teachers.score_group(g) for g in groups]

    return asyncio.run(run())


def test_self_teacher_gives_zero_signal_one_sample_and_top_k(qwen3_server) -> None:
    for top_k, which in ((0, "student"), (3, "student"), (3, "intersection")):
        groups = asyncio.run(_groups(qwen3_server.url, top_k))
        teachers = ServedTeachers({None: qwen3_server.url}, TeacherSettings(top_k=top_k, top_k_set=which))
        assert _score(teachers, groups) == [None, None]
        for s in (s for g in groups for s in g):
            assert len(s.teacher_logprobs) == s.response_length
            assert (TOPK_KEY in s.metadata) == bool(top_k)
            if top_k:
                assert all(len(r) >= 1 for r in s.metadata[TOPK_KEY]["student"])
            torch.testing.assert_close(sample_signal(s), torch.zeros(s.response_length, dtype=torch.float64),
                                       atol=1e-4, rtol=0)
        m = teachers.take_metrics()
        assert m["scored_samples/teacher"] == 4 and m["teacher_time"] > 0
        assert teachers.take_metrics()["teacher_time"] == 0.0  # reset after reading


def test_teachers_by_tag_and_an_unrouted_prompt(qwen3_server) -> None:
    groups = asyncio.run(_groups(qwen3_server.url, 0))
    teachers = ServedTeachers({"math": qwen3_server.url}, TeacherSettings())
    errors = _score(teachers, groups)
    assert errors[0] is None and "no teacher for metadata.teacher 'code'" in errors[1]
    assert all(s.teacher_logprobs is None for s in groups[1])
    m = teachers.take_metrics()
    assert m["scored_samples/math"] == 2 and m["unrouted_groups"] == 1


def test_tokenizer_check_at_start(qwen3_server, qwen3_tokenizer, qwen3_dir: Path) -> None:
    good = list(qwen3_tokenizer.encode(PROBE))
    vocab = json.loads((qwen3_dir / "config.json").read_text())["vocab_size"]
    teachers = ServedTeachers({None: qwen3_server.url}, TeacherSettings())
    asyncio.run(teachers.check(good, vocab))
    with pytest.raises(TeacherError, match="must share the student's tokenizer"):
        asyncio.run(teachers.check(good[::-1], None))
    with pytest.raises(TeacherError, match="vocab_size"):
        asyncio.run(teachers.check(good, 7))
    gone = ServedTeachers({None: "http://127.0.0.1:9"}, TeacherSettings(timeout_s=5))
    with pytest.raises(TeacherError, match="cannot be used"):
        asyncio.run(gone.check(good, None))


class _BadTeacher(BaseHTTPRequestHandler):
    """Answers every scoring request one log-prob short, or with 500 when the path says so."""

    mode = "short"
    calls = 0

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        if self.mode == "error":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "boom"}}')
            return
        ids = body["input_ids"][body["logprob_start_len"]:]
        rows = [[-1.0, t, None] for t in ids[:-1]]
        data = json.dumps({"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": rows}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("mode, needle", [("short", "wrong lengths"), ("error", "boom")])
def test_a_bad_teacher_gives_the_group_up_whole(qwen3_server, mode: str, needle: str) -> None:
    handler = type("H", (_BadTeacher,), {"mode": mode, "calls": 0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        teachers = ServedTeachers({None: url}, TeacherSettings(retries=1, retry_backoff_s=0.01))

        async def run():
            async with EngineClient(qwen3_server.url) as c:
                return await rollout_groups([c], _items(), 2, SAMPLING, lambda s: 1.0,
                                            finish_group=teachers.score_group)

        result = asyncio.run(run())
        assert result.groups == [] and result.num_teacher_failures == 2 and len(result.requeue) == 2
        assert teachers.take_metrics()["teacher_failed_groups/teacher"] == 2
        # the 500s were retried once per sample: 2 groups x 2 samples x 2 tries
        assert handler.calls == (8 if mode == "error" else 4)
    finally:
        srv.shutdown()
        srv.server_close()


def _in_process_teacher(rank: int, world: int, model: str, samples: list) -> list[torch.Tensor]:
    settings = TrainerSettings(lr=0.0, global_batch_size=len(samples), max_tokens_per_micro_batch=64,
                               opd_teacher_checkpoint=model)
    backend = FSDPBackend.create(model, settings)
    return backend.compute_logprobs(samples, teacher=True)


def test_in_process_teacher_matches_the_served_one(qwen3_server, qwen3_dir: Path) -> None:
    groups = asyncio.run(_groups(qwen3_server.url, 0))
    for g in groups:
        for s in g:
            s.reward = float(s.index)
    teachers = ServedTeachers({None: qwen3_server.url}, TeacherSettings())
    assert _score(teachers, groups) == [None, None]
    samples = [s for g in groups for s in g]
    served = [torch.tensor(s.teacher_logprobs) for s in samples]
    [local] = run_ranks(_in_process_teacher, 1, str(qwen3_dir), samples, timeout_s=300)
    for a, b in zip(local, served):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    masks = [torch.ones(s.response_length) for s in samples]
    adv = estimate("grpo", samples, AdvantageSettings()).advantages
    from_served = apply_opd(adv, [sample_signal(s) for s in samples], masks, 1.0)
    for s, t in zip(samples, local):
        s.teacher_logprobs = t.tolist()
    from_local = apply_opd(adv, [sample_signal(s) for s in samples], masks, 1.0)
    for a, b in zip(from_served, from_local):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
