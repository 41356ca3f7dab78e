"""Reward functions: builtins by name (`exact_match`, `math`, `math_verify`) or any callable by path.

A reward function scores one sample (`RewardFn`); a group reward function scores a whole group at
once (`GroupRewardFn`, e.g. ranking the attempts against each other). Either may be async.

A reward function that raises, or returns something other than a finite number, is never
turned into a reward of 0: that would train on a wrong signal and hide the bug. `score_group`
reports the error instead; the rollout fn then keeps the group out of training, counts it and
logs the first error (see `milepost.rollout.generate.rollout_groups`).
"""

from __future__ import annotations

import inspect
import math as _math
import re
from collections.abc import Awaitable, Callable
from fractions import Fraction
from typing import Any

from milepost.plugins import load_callable
from milepost.types import Sample

RewardFn = Callable[[Sample], float | Awaitable[float]]
GroupRewardFn = Callable[[list[Sample]], list[float] | Awaitable[list[float]]]


# ---- answer extraction and normalization -----------------------------------------------------

def final_text(response: str) -> str | None:
    """The part of a response after its reasoning: text after the last `</think>`.

    None when a `<think>` block was opened and never closed (the model ran out of tokens while
    thinking): a number inside unfinished reasoning is not an answer.
    """
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    if "<think>" in response:
        return None
    return response


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None  # every box is unclosed


_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)


def extract_answer(response: str) -> str | None:
    """The final answer of a math response: last `\\boxed{}`, else "answer is X" / "Answer: X"
    (the last one, up to the end of its line), else the last number. None if there is none."""
    text = final_text(response)
    if text is None:
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    said = list(_ANSWER_IS.finditer(text))
    if said:
        answer = said[-1].group(1).splitlines()[0].strip().rstrip(".").strip()
        counted = re.fullmatch(rf"({_NUMBER})\s+[A-Za-z][A-Za-z ]*", answer)  # "5 apples"
        if counted:
            return counted.group(1)
        if answer:
            return answer
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer: no `$`, spaces, `\\left`/`\\right`, `\\text{}` wrappers,
    thousands separators, trailing period or leading `x=`; `\\dfrac{a}{b}`, `\\frac ab` -> `a/b`;
    numbers in lowest terms ("3.0" -> "3", "6/4" -> "3/2", "0.5" -> "1/2")."""
    s = answer.strip()
    s = re.sub(r"\\text\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right|!|,|;|:|displaystyle)", "", s)
    s = s.replace("$", "").replace("\\%", "%")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\1/\2", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[a-zA-Z]=(?!=)", "", s)  # "x=5" -> "5"
    number = parse_number(s)
    if number is not None:
        return _format(number)
    return s


def parse_number(s: str) -> Fraction | None:
    """An exact number from "3", "-3.50", "1,000", "3/4", "-(3)/(4)", "50%" (= 50)... else None."""
    s = s.strip().replace(" ", "").removesuffix("%")
    sign = -1 if s.startswith("-") else 1
    s = s.removeprefix("-").removeprefix("+")
    m = re.fullmatch(r"\(?(-?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d+)?)\)?(?:/\(?(-?\d+)\)?)?", s)
    if m is None or not re.search(r"\d", m.group(1)):
        return None
    try:
        value = Fraction(m.group(1).replace(",", ""))
        if m.group(2) is not None:
            value /= Fraction(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return sign * value


def _format(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _label_text(label: Any) -> str:
    if isinstance(label, float) and label.is_integer():
        return str(int(label))
    text = str(label)
    return last_boxed(text) or text


# ---- builtin reward functions ----------------------------------------------------------------

def exact_match(sample: Sample) -> float:
    """1.0 when the response's final text (after any reasoning) equals the label, ignoring case,
    surrounding whitespace, repeated spaces and a trailing period; else 0.0."""
    text = final_text(sample.response)
    if text is None or sample.label is None:
        return 0.0

    def norm(s: str) -> str:
        return re.sub(r"\s+", " ", s).strip().rstrip(".").strip().casefold()

    return float(norm(text) == norm(str(sample.label)))


def math_reward(sample: Sample) -> float:
    """1.0 when the response's final answer (see `extract_answer`) equals the label once both are
    normalized (numbers compared exactly: "3.0" == "3", "0.5" == "1/2"); else 0.0."""
    answer = extract_answer(sample.response)
    if answer is None or sample.label is None:
        return 0.0
    return float(normalize_answer(answer) == normalize_answer(_label_text(sample.label)))


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_reward}


# ---- loading and calling ---------------------------------------------------------------------

def load_reward_fn(name: str, setting: str = "reward_fn") -> RewardFn:
    """A builtin reward function by name, or any callable by import path `module.sub:function`."""
    if ":" in name:
        return load_callable(name, setting)
    if name == "math_verify":  # an optional package (milepost[math]): checked here, at start
        from milepost.connectors.math_verify_reward import _module, math_verify_reward
        try:
            _module()
        except ImportError as e:  # MissingExtraError: its message names the extra
            raise ValueError(f"{setting}: {e}") from e
        return math_verify_reward
    if name not in BUILTIN_REWARDS:
        raise ValueError(f"{setting}: unknown reward function {name!r}; builtins are "
                         f"{sorted([*BUILTIN_REWARDS, 'math_verify'])}, or give an import path "
                         "'module.sub:function'")
    return BUILTIN_REWARDS[name]


def load_group_reward_fn(name: str, setting: str = "group_reward_fn") -> GroupRewardFn:
    """A group reward function by import path `module.sub:function` (there are no builtins)."""
    if ":" not in name:
        raise ValueError(f"{setting}: give an import path 'module.sub:function', got {name!r}")
    return load_callable(name, setting)


def _check_reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _math.isfinite(value):
        raise TypeError(f"{what} returned {value!r}; a reward must be a finite number")
    return float(value)


async def _call(fn: Callable[..., Any], arg: Any) -> Any:
    # Sync functions run on the event loop thread: a slow or blocking reward should be async.
    out = fn(arg)
    return await out if inspect.isawaitable(out) else out


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


async def score_group(group: list[Sample], reward_fn: RewardFn | None,
                      group_reward_fn: GroupRewardFn | None = None) -> str | None:
    """Set `reward` on every sample of a group. Returns None, or the first error's description.

    With both functions, `reward_fn` scores each sample first and `group_reward_fn` then sees the
    group (per-sample rewards set) and returns the final rewards, one per sample. On error the
    failing sample gets `metadata["reward_error"]` and the group's rewards are left unset.
    """
    if reward_fn is None and group_reward_fn is None:
        raise ValueError("score_group: give a reward_fn, a group_reward_fn, or both")
    error = None
    if reward_fn is not None:
        for s in group:
            try:
                s.reward = _check_reward(await _call(reward_fn, s), _name(reward_fn))
            except Exception as e:  # noqa: BLE001 - a user's function may raise anything; reported
                s.metadata["reward_error"] = error = f"{_name(reward_fn)}: {type(e).__name__}: {e}"
    if error is None and group_reward_fn is not None:
        try:
            rewards = await _call(group_reward_fn, group)
            if not isinstance(rewards, (list, tuple)) or len(rewards) != len(group):
                raise TypeError(f"returned {rewards!r}; expected a list of {len(group)} rewards")
            values = [_check_reward(r, _name(group_reward_fn)) for r in rewards]
        except Exception as e:  # noqa: BLE001
            error = f"{_name(group_reward_fn)}: {type(e).__name__}: {e}"
            for s in group:
                s.metadata["reward_error"] = error
        else:
            for s, r in zip(group, values):
                s.reward = r
    if error is not None:
        for s in group:
            s.reward = None
    return error
