"""`--reward-fn math_verify`: math answers graded by Hugging Face's `math-verify` package.

The model's final text (after any `</think>`) is parsed as the major RL recipes do: its last
`\\boxed{}` when it has one, else the LaTeX and plain expressions math-verify finds; the label is parsed the same way and the
two compared symbolically (`\\frac{2}{4}` == `0.5`). Needs `pip install 'milepost[math]'`.
"""

from __future__ import annotations

import threading
from typing import Any

from milepost.connectors.extras import require
from milepost.rollout.rewards import final_text, last_boxed
from milepost.types import Sample

# math-verify bounds parsing and comparison with SIGALRM, which only the main thread may use;
# elsewhere the bounds are off (its sympy work is then unbounded, as documented).
_TIMEOUT_S = 5


def _module() -> Any:
    return require("math_verify", "math", "--reward-fn math_verify")


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_gold(label: Any) -> list[Any]:
    """The label parsed by math-verify; a bare answer ("1/2", "\\frac12") is tried as LaTeX too."""
    mv = _module()
    text = str(label).strip()
    parsed = mv.parse(text, parsing_timeout=_timeout())
    if len(parsed) < 2 and "$" not in text:
        parsed = mv.parse(f"${text}$", parsing_timeout=_timeout())
    return parsed if len(parsed) >= 2 else []  # [expression, text]; the text alone: not math


def math_verify_reward(sample: Sample) -> float:
    """1.0 when the response's final answer is mathematically equal to the label; else 0.0
    (no answer, an answer inside unfinished reasoning, or no label all score 0.0)."""
    mv = _module()
    text = final_text(sample.response)
    if text is None or sample.label is None:
        return 0.0
    gold = parse_gold(sample.label)
    if not gold:
        raise ValueError(f"math_verify could not parse the label {sample.label!r} as math")
    boxed = last_boxed(text)  # math-verify alone would take the first box; the last one counts
    answer = mv.parse(text if boxed is None else f"\\boxed{{{boxed}}}", parsing_timeout=_timeout())
    if not answer:
        return 0.0
    return float(mv.verify(gold, answer, timeout_seconds=_timeout()))
