"""Served teachers of on-policy distillation (report 5.2): score finished trajectories during rollout.

Any SGLang-protocol server scores a sample's response on the student's own token ids (prompt
log-probs, `max_new_tokens: 0`), so it must share the student's tokenizer: `check` compares the
vocabulary size and a probe string's ids at start. A group is scored as soon as it is complete,
while other groups still generate; it gets every sample's signal or none (a failure after
retries gives the group up, to be retried and counted, never trained with a partial signal).
Several teachers: each prompt's `metadata.teacher` tag picks one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from milepost.opd_rules import served_teachers
from milepost.rollout.client import EngineClient, EngineError
from milepost.train.distill import TOPK_KEY
from milepost.types import Group, Sample

log = logging.getLogger(__name__)

PROBE = "milepost teacher probe: 12 + 34 = 46; ¿Qué tal? 你好 <|im_start|>\n"
STUDENT_TOP_KEY = "student_top_logprobs"  # generate_one's per-token top [logprob, id] pairs
TAG_KEY = "teacher"  # the prompt's metadata field that routes it


class TeacherError(RuntimeError):
    """A teacher cannot score (at start: the run is refused; during rollout: the group is given up)."""


@dataclass(frozen=True)
class TeacherSettings:
    """temperature: the rollout's (both log-probs are taken at it). top_k / top_k_set: see
    --opd-top-k. timeout_s / retries: per scoring request. concurrency: requests per teacher."""

    temperature: float = 1.0
    top_k: int = 0
    top_k_set: str = "student"
    timeout_s: float = 300.0
    retries: int = 2
    retry_backoff_s: float = 0.5
    concurrency: int = 64


class ServedTeachers:
    """tag -> teacher URL (the tag None takes every prompt). Use from one event loop at a time;
    `take_metrics` may be called from another thread."""

    def __init__(self, urls: dict[str | None, str], settings: TeacherSettings) -> None:
        if not urls:
            raise ValueError("ServedTeachers: no teacher URL")
        self.urls = dict(urls)
        self.settings = settings
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._time = 0.0  # wall seconds with at least one group being scored
        self._tokens = 0
        self._active = 0
        self._busy_since = 0.0
        # requests in flight per teacher; a semaphore serves one event loop, and the sync driver
        # runs a new loop per rollout (the fully-async worker keeps one)
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    # ---- start -------------------------------------------------------------------------------
    async def check(self, probe_ids: list[int], vocab_size: int | None) -> None:
        """Refuse a teacher that is unreachable or tokenizes differently from the student.
        probe_ids: the student tokenizer's ids of PROBE (special tokens as `encode` adds them)."""
        for tag, url in self.urls.items():
            name = f"teacher {url}" + (f" (tag {tag!r})" if tag is not None else "")
            async with EngineClient(url, timeout_s=self.settings.timeout_s) as c:
                try:
                    info = await c.get_model_info()
                    body = (await c.score(PROBE, 0)).get("input_token_logprobs") or []
                except EngineError as e:
                    raise TeacherError(f"{name} cannot be used: {e}; start it, or fix "
                                       "--opd-teacher-url / [[opd.teachers]]") from None
            theirs = info.get("vocab_size")
            if vocab_size is not None and theirs is not None and int(theirs) != vocab_size:
                raise TeacherError(f"{name} has vocab_size {theirs}, the student {vocab_size}: a "
                                   "served teacher must share the student's tokenizer")
            ids = [int(e[1]) for e in body]
            if ids != list(probe_ids):
                raise TeacherError(f"{name} tokenizes the probe {PROBE!r} as {ids[:12]}..., the "
                                   f"student as {list(probe_ids)[:12]}...: a served teacher must "
                                   "share the student's tokenizer (it scores the student's ids)")

    def url_for(self, s: Sample) -> str | None:
        if None in self.urls:
            return self.urls[None]
        return self.urls.get(s.metadata.get(TAG_KEY))

    # ---- rollout -----------------------------------------------------------------------------
    async def score_group(self, group: Group) -> str | None:
        """Fill every sample's teacher signal; None, or why the group cannot be trained on (then
        no sample keeps a partial signal)."""
        url = self.url_for(group[0])
        if url is None:
            tag = group[0].metadata.get(TAG_KEY)
            self._count("unrouted_groups")
            return f"no teacher for metadata.teacher {tag!r} (teachers: {sorted(map(str, self.urls))})"
        self._busy(+1)
        try:
            async with EngineClient(url, timeout_s=self.settings.timeout_s) as c:
                # every request ends before the client closes; then the first failure counts
                done = await asyncio.gather(*(self._score_sample(c, s) for s in group),
                                            return_exceptions=True)
            failed = next((e for e in done if isinstance(e, BaseException)), None)
            if failed is not None:
                raise failed
        except (TeacherError, EngineError) as e:
            for s in group:
                s.teacher_logprobs = None
                s.metadata.pop(TOPK_KEY, None)
            self._count(f"teacher_failed_groups/{self._name(url)}")
            log.warning("teacher %s: group %d given up: %s", url, group[0].group_index, e)
            return f"teacher {url}: {e}"
        finally:
            self._busy(-1)
        with self._lock:
            self._tokens += sum(len(s.tokens) for s in group)
            self._counts[f"scored_samples/{self._name(url)}"] += len(group)
        return None

    async def _score_sample(self, c: EngineClient, s: Sample) -> None:
        st = self.settings
        student_top = s.metadata.pop(STUDENT_TOP_KEY, None) if st.top_k else None
        union = sorted({int(i) for row in student_top or [] for _, i in row})
        loop = asyncio.get_running_loop()
        if loop is not self._slots_loop:
            self._slots, self._slots_loop = {}, loop
        slots = self._slots.setdefault(c.base_url, asyncio.Semaphore(st.concurrency))
        for attempt in range(st.retries + 1):
            try:
                async with slots:
                    meta = await c.score(s.tokens, s.prompt_length, temperature=st.temperature,
                                         top_logprobs_num=st.top_k if st.top_k_set == "intersection" else 0,
                                         token_ids_logprob=union or None, timeout_s=st.timeout_s)
                break
            except EngineError as e:
                if attempt == st.retries:
                    raise
                await asyncio.sleep(st.retry_backoff_s * 2**attempt)
                log.warning("teacher %s: retry %d/%d (%s)", c.base_url, attempt + 1, st.retries, e)
        s.teacher_logprobs = _sampled(meta, s)
        if st.top_k:
            if student_top is None or len(student_top) != s.response_length:
                raise TeacherError(f"sample {s.group_index}/{s.index} has no student top-{st.top_k} "
                                   "log-probs for every response token")
            s.metadata[TOPK_KEY] = _topk_rows(meta, s, student_top, st.top_k_set)

    def _busy(self, delta: int) -> None:
        """Groups are scored concurrently: time counts once while any is being scored."""
        with self._lock:
            now = time.perf_counter()
            if self._active == 0 and delta > 0:
                self._busy_since = now
            self._active += delta
            if self._active == 0:
                self._time += now - self._busy_since

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _name(self, url: str) -> str:
        return next((str(t) for t, u in self.urls.items() if u == url and t is not None), "teacher")

    def take_metrics(self) -> dict[str, float]:
        """Since the last call (no prefix; the driver adds `opd/`): teacher_time (wall seconds with
        a group being scored; it overlaps generation), teacher_tokens_per_s (scored sequence
        tokens over that time), and counts per teacher (scored_samples/<tag> always present)."""
        with self._lock:
            busy = self._time
            if self._active:  # a group still being scored (fully async): count up to now
                now = time.perf_counter()
                busy += now - self._busy_since
                self._busy_since = now
            # every teacher's count appears each step, 0 included: under --fully-async the worker
            # can score a step's groups during an earlier step, and a missing key reads as a gap
            scored = {f"scored_samples/{self._name(u)}": 0.0 for u in self.urls.values()}
            out = {"teacher_time": busy, **scored, **{k: float(v) for k, v in self._counts.items()}}
            if busy > 0:
                out["teacher_tokens_per_s"] = self._tokens / busy
            self._counts.clear()
            self._time, self._tokens = 0.0, 0
        return out


def _finite(x: object, where: str) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        raise TeacherError(f"{where}: log-prob {x!r} is not a finite number")
    return float(x)


def _sampled(meta: dict, s: Sample) -> list[float]:
    """The teacher's log-prob of each response token, checked against the response ids."""
    rows = meta.get("input_token_logprobs") or []
    if len(rows) != s.response_length:
        raise TeacherError(f"returned {len(rows)} log-probs for a response of {s.response_length} "
                           "tokens (wrong lengths: not trained on)")
    ids = [int(r[1]) for r in rows]
    if ids != s.response_ids:
        raise TeacherError("scored ids differ from the student's response ids")
    return [_finite(r[0], "input_token_logprobs") for r in rows]


def _topk_rows(meta: dict, s: Sample, student_top: list, which: str) -> dict:
    """Per position the candidate set's student and teacher log-probs (distill.TOPK_KEY)."""
    by_id = meta.get("input_token_ids_logprobs") or []
    if len(by_id) != s.response_length:
        raise TeacherError(f"returned {len(by_id)} rows of token_ids_logprob for "
                           f"{s.response_length} positions")
    tops = meta.get("input_top_logprobs") or [] if which == "intersection" else None
    if tops is not None and len(tops) != s.response_length:
        raise TeacherError(f"returned {len(tops)} rows of top log-probs for {s.response_length} positions")
    student, teacher = [], []
    for t, row in enumerate(student_top):
        t_lp = {int(e[1]): _finite(e[0], "input_token_ids_logprobs") for e in by_id[t]}
        cand = [(lp, i) for lp, i in row]
        if tops is not None:
            theirs = {int(e[1]) for e in tops[t]}
            cand = [(lp, i) for lp, i in cand if i in theirs]
        if not cand:  # empty intersection: the sampled token alone
            student.append([s.rollout_logprobs[t]])
            teacher.append([s.teacher_logprobs[t]])
            continue
        missing = [i for _, i in cand if i not in t_lp]
        if missing:
            raise TeacherError(f"position {t}: no teacher log-prob for candidate ids {missing[:4]}")
        student.append([float(lp) for lp, _ in cand])
        teacher.append([t_lp[i] for _, i in cand])
    return {"student": student, "teacher": teacher}


def start_served_teachers(urls: dict[str | None, str], settings: TeacherSettings, probe_ids: list[int],
                          vocab_size: int | None, prompt_tags: list[str | None] | None = None,
                          ) -> ServedTeachers:
    """The run's served teachers, checked (reachable, same tokenizer) before the first rollout.
    prompt_tags: the dataset's metadata.teacher values; with tagged teachers, a tag no teacher
    takes is refused here, naming it."""
    teachers = ServedTeachers(urls, settings)
    if None not in urls and prompt_tags is not None:
        unknown = sorted({str(t) for t in prompt_tags if t not in urls})
        if unknown:
            raise TeacherError(f"prompts carry metadata.teacher {unknown} but [[opd.teachers]] has "
                               f"tags {sorted(map(str, urls))}; add a teacher for each tag or fix "
                               "the data")
    asyncio.run(teachers.check(probe_ids, vocab_size))
    return teachers


def teachers_of_run(cfg, tokenizer, items: list) -> ServedTeachers | None:
    """The run's served teachers (None without one), checked against the student's `tokenizer`
    and the tags of the prompt `items`. `cfg` is the run's TrainConfig. Raises TeacherError."""
    urls = served_teachers(cfg)
    if not urls:
        return None
    settings = TeacherSettings(
        temperature=cfg.rollout_temperature, top_k=cfg.opd_top_k, top_k_set=cfg.opd_top_k_set,
        timeout_s=cfg.opd_teacher_timeout_s, retries=cfg.opd_teacher_retries,
        concurrency=int(cfg.rollout_max_concurrency))
    config = json.loads((Path(cfg.hf_checkpoint) / "config.json").read_text())
    return start_served_teachers(urls, settings, list(tokenizer.encode(PROBE)),
                                 config.get("vocab_size"), [it.metadata.get(TAG_KEY) for it in items])
