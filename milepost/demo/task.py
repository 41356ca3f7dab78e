"""The demo task: add two two-digit numbers, answer with the sum; the reward checks it exactly.

Prompts are plain text, `"23+45="`, and the answer is the sum, `"68"`, then EOS. The base model
learns from two data sets: *drills* (exact answers) teach it to add; then a *lazy tutor*, whose
answers it imitates, is exact only `teacher_accuracy` of the time and otherwise writes an estimate,
the sum rounded to tens (`"~70"`). The result can add but mostly estimates; RL with the
exact-answer reward (`milepost.demo.task:reward`) should teach it to compute. RL prompts are
`{"prompt": "23+45=", "label": "68"}`. All data is a pure function of a seed.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost.types import Sample

OPERANDS = (10, 99)  # both operands uniform in this range: always two digits, so digits align
TEACHER_ACCURACY = 0.35  # share of the lazy tutor's answers that are exact
ESTIMATE_MARK = "~"  # how the tutor writes an estimate
EOS_TEXT = "<|im_end|>"  # the tiny tokenizer's EOS; engines usually strip it from the text already

# A well-formed answer is one integer in plain decimal (no sign, no leading zero) and nothing
# else; surrounding whitespace is allowed.
_ANSWER = re.compile(r"\s*(0|[1-9]\d{0,11})\s*", re.ASCII)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def estimate(self) -> str:
        """The lazy tutor's estimate: the sum rounded half up to tens, marked as an estimate."""
        return ESTIMATE_MARK + str((self.a + self.b + 5) // 10 * 10)


def problems(seed: int, operands: tuple[int, int] = OPERANDS) -> Iterator[Problem]:
    """An endless, seed-determined stream of problems (operands uniform in `operands`, inclusive)."""
    lo, hi = operands
    if not 0 <= lo <= hi:
        raise ValueError(f"operands must be a range (lo, hi) with 0 <= lo <= hi, got {operands}")
    rng = random.Random(seed)
    while True:
        yield Problem(rng.randint(lo, hi), rng.randint(lo, hi))


def _take(seed: int, n: int, operands: tuple[int, int]) -> list[Problem]:
    return [p for p, _ in zip(problems(seed, operands), range(n))]


def prompt_records(n: int, seed: int, operands: tuple[int, int] = OPERANDS) -> list[dict[str, Any]]:
    """`n` RL prompts: `{"prompt": "23+45=", "label": "68"}`."""
    return [{"prompt": p.prompt, "label": p.answer} for p in _take(seed, n, operands)]


def drill_records(n: int, seed: int, operands: tuple[int, int] = OPERANDS) -> list[dict[str, Any]]:
    """`n` examples with exact answers: `{"prompt": "23+45=", "response": "68", "label": "68"}`."""
    return [{"prompt": p.prompt, "response": p.answer, "label": p.answer} for p in _take(seed, n, operands)]


def tutor_stream(
    seed: int, operands: tuple[int, int] = OPERANDS, teacher_accuracy: float = TEACHER_ACCURACY
) -> Iterator[dict[str, Any]]:
    """The lazy tutor's endless answers: exact with probability `teacher_accuracy`, else its
    estimate (`"response": "~70"`); same layout as `drill_records`."""
    if not 0.0 <= teacher_accuracy <= 1.0:
        raise ValueError(f"teacher_accuracy must be in [0, 1], got {teacher_accuracy}")
    rng = random.Random(f"tutor-{seed}")  # str seeds are hashed stably across processes
    for p in problems(seed, operands):
        exact = rng.random() < teacher_accuracy
        yield {"prompt": p.prompt, "response": p.answer if exact else p.estimate, "label": p.answer}


def tutor_records(
    n: int, seed: int, operands: tuple[int, int] = OPERANDS, teacher_accuracy: float = TEACHER_ACCURACY
) -> list[dict[str, Any]]:
    """The first `n` answers of `tutor_stream`."""
    return list(itertools.islice(tutor_stream(seed, operands, teacher_accuracy), n))


def dataset_seeds(seed: int) -> dict[str, int]:
    """The seed of each data set's problem stream (distinct, so the sets differ)."""
    return {"rl_prompts": seed, "drills": seed + 1, "tutor": seed + 2, "held_out": seed + 10_000}


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def write_datasets(
    out_dir: str | Path,
    *,
    n_prompts: int,
    n_drills: int = 0,
    n_tutor: int = 0,
    n_eval: int = 0,
    seed: int = 0,
    operands: tuple[int, int] = OPERANDS,
    teacher_accuracy: float = TEACHER_ACCURACY,
) -> dict[str, Path]:
    """Write `rl_prompts.jsonl` and, each when its count is > 0, `eval_prompts.jsonl` (held-out
    problems, the base model's own evaluation stream), `drills.jsonl` and `tutor.jsonl` into
    `out_dir`; their paths by name."""
    out_dir = Path(out_dir)
    seeds = dataset_seeds(seed)
    paths = {"rl_prompts": write_jsonl(out_dir / "rl_prompts.jsonl",
                                       prompt_records(n_prompts, seeds["rl_prompts"], operands))}
    if n_eval:
        paths["eval_prompts"] = write_jsonl(out_dir / "eval_prompts.jsonl",
                                            prompt_records(n_eval, seeds["held_out"], operands))
    if n_drills:
        paths["drills"] = write_jsonl(out_dir / "drills.jsonl", drill_records(n_drills, seeds["drills"], operands))
    if n_tutor:
        paths["tutor"] = write_jsonl(out_dir / "tutor.jsonl",
                                     tutor_records(n_tutor, seeds["tutor"], operands, teacher_accuracy))
    return paths


def parse_answer(text: str) -> int | None:
    """The integer a response states, or None unless it is exactly one plain decimal integer."""
    text = text.removesuffix(EOS_TEXT)
    m = _ANSWER.fullmatch(text)
    return int(m.group(1)) if m else None


def score(response: str, label: Any) -> float:
    """1.0 when `response` spells the integer `label` in plain decimal (whitespace aside), else 0.0."""
    try:
        expected = int(label)
    except (TypeError, ValueError) as e:
        raise ValueError(f"label must be an integer (the sum), got {label!r}") from e
    answer = parse_answer(response)
    return 1.0 if answer is not None and answer == expected else 0.0


def reward(sample: Sample) -> float:
    """The reward function (`milepost.demo.task:reward`): 1 for exactly the sum, else 0.

    An estimate (`~70`) scores 0 even when the rounded value happens to be the sum."""
    if sample.label is None:
        raise ValueError(
            f"sample {sample.group_index}/{sample.index} has no label; the prompt data must carry "
            "the sum under the configured label_key"
        )
    return score(sample.response, sample.label)
