"""Refusals and derived defaults of the on-policy distillation settings (config table [opd]).

Kept beside config_rules.py (which calls them) so the distillation rules read in one place:
one teacher kind per run, top-K with a served teacher only, an in-process teacher of the
student's architecture and vocabulary, well-formed [[opd.teachers]] entries.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milepost.config import TrainConfig

_URL = re.compile(r"^https?://[^/\s]+")


def opd_enabled(c: TrainConfig) -> bool:
    return bool(c.opd_teacher_url or c.opd_teacher_checkpoint or c.teachers)


def served_teachers(c: TrainConfig) -> dict[str | None, str]:
    """tag -> url of the served teachers; the single --opd-teacher-url has tag None (every prompt)."""
    if c.opd_teacher_url:
        return {None: c.opd_teacher_url.rstrip("/")}
    return {t["tag"]: t["url"].rstrip("/") for t in c.teachers or []}


def opd_refusals(c: TrainConfig) -> list[str]:
    """Every invalid combination of the [opd] settings, naming the settings and the fix."""
    p: list[str] = []
    kinds = [name for name, v in (("--opd-teacher-url", c.opd_teacher_url),
                                  ("--opd-teacher-checkpoint", c.opd_teacher_checkpoint),
                                  ("[[opd.teachers]]", c.teachers)) if v]
    if len(kinds) > 1:
        p.append(f"{' and '.join(kinds)} are given together; a run distils from one served teacher, "
                 "one in-process teacher, or several served teachers by tag: keep one")
    if not kinds:
        if c.opd_coef is not None:
            p.append(f"--opd-coef {c.opd_coef} needs a teacher: add --opd-teacher-url, "
                     "--opd-teacher-checkpoint or [[opd.teachers]], or drop --opd-coef")
        if c.opd_top_k:
            p.append(f"--opd-top-k {c.opd_top_k} needs a served teacher (--opd-teacher-url or "
                     "[[opd.teachers]])")
        if not c.opd_task_reward:
            p.append("--no-opd-task-reward would train on no signal at all without a teacher; add "
                     "a teacher or drop it")
        return p
    if c.opd_teacher_url and not _URL.match(c.opd_teacher_url):
        p.append(f"--opd-teacher-url {c.opd_teacher_url!r} is not an http(s)://host:port URL")
    if c.teachers is not None:
        p += _teachers_refusals(c.teachers)
    if c.opd_teacher_checkpoint is not None:
        p += _checkpoint_refusals(c.opd_teacher_checkpoint, c.hf_checkpoint)
        if c.opd_top_k:
            p.append(f"--opd-top-k {c.opd_top_k} needs a served teacher (the report offers top-K "
                     "with a served teacher only); drop --opd-top-k or use --opd-teacher-url")
    if c.load_rollouts is not None or c.rollout_only:
        p.append("on-policy distillation trains on the student's own fresh trajectories; it cannot "
                 "be used with --load-rollouts or --rollout-only")
    if any(getattr(c, k) for k in ("rollout_function_path", "custom_generate_function_path",
                                   "agent_function_path", "use_session_server")):
        p.append("on-policy distillation is not wired into the plug-in rollout layers or the "
                 "session server yet; drop the teacher or the rollout plug-ins")
    return p


def _teachers_refusals(teachers: list[dict[str, str]]) -> list[str]:
    p: list[str] = []
    if not teachers:
        return ["[[opd.teachers]] is empty; give at least one {url, tag}, or leave it out"]
    tags: list[str] = []
    for i, t in enumerate(teachers):
        extra = sorted(set(t) - {"url", "tag"})
        if extra or "url" not in t or "tag" not in t:
            p.append(f"[[opd.teachers]] entry {i} is {json.dumps(t)}; each needs exactly url and tag"
                     + (f" (unknown: {extra})" if extra else ""))
            continue
        if not _URL.match(t["url"]):
            p.append(f"[[opd.teachers]] entry {i}: url {t['url']!r} is not an http(s)://host:port URL")
        if not t["tag"]:
            p.append(f"[[opd.teachers]] entry {i}: tag is empty; prompts name it in metadata.teacher")
        tags.append(t["tag"])
    dupes = sorted({t for t in tags if tags.count(t) > 1})
    if dupes:
        p.append(f"[[opd.teachers]]: tags {dupes} are given twice; each tag routes to one teacher")
    return p


def _checkpoint_refusals(teacher: Path, student: Path) -> list[str]:
    """The in-process teacher is sharded like the student: same architecture and vocabulary."""
    cfg_path = Path(teacher) / "config.json"
    if not cfg_path.is_file():
        return [f"--opd-teacher-checkpoint {teacher} is not a Hugging Face model directory (no "
                "config.json); pass what save_pretrained wrote"]
    try:
        t_cfg = json.loads(cfg_path.read_text())
        s_cfg = json.loads((Path(student) / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [f"--opd-teacher-checkpoint {teacher}: cannot read config.json ({e})"]
    p = []
    for key in ("model_type", "vocab_size"):
        if t_cfg.get(key) != s_cfg.get(key):
            p.append(f"--opd-teacher-checkpoint {teacher} has {key} {t_cfg.get(key)!r} but the student "
                     f"(--hf-checkpoint) has {s_cfg.get(key)!r}; an in-process teacher shares the "
                     "student's architecture and tokenizer (a different one: serve it, "
                     "--opd-teacher-url)")
    return p


def opd_coef_default(c: TrainConfig) -> float | None:
    """--opd-coef once resolved: 1.0 with a teacher when not given."""
    return (1.0 if c.opd_coef is None else c.opd_coef) if opd_enabled(c) else c.opd_coef
