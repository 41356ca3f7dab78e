"""`--reward-fn math_verify`: real answers graded by the real `math-verify` package."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from milepost.config import ConfigError, load_config
from milepost.connectors.extras import MissingExtraError
from milepost.rollout.rewards import load_reward_fn, score_group
from milepost.types import Sample

pytest.importorskip("math_verify", reason="needs milepost[math]")


def _sample(response: str, label: object) -> Sample:
    return Sample(group_index=0, index=0, tokens=[1, 2], response_length=1, response=response,
                  label=label)


@pytest.fixture(scope="module")
def reward():
    return load_reward_fn("math_verify")


@pytest.mark.parametrize(("response", "label"), [
    ("So the probability is \\boxed{\\frac{2}{4}}.", "\\frac{1}{2}"),   # equivalent fractions
    ("The answer is $0.5$", "1/2"),                                      # plain label, decimal
    ("First \\boxed{3}, no wait: \\boxed{7}", "7"),                      # the last box counts
    ("<think>maybe 9</think> Therefore $x = \\boxed{\\sqrt{4}}$", "2"),  # after the reasoning
    ("We get \\boxed{2\\pi r}", "$2 r \\pi$"),                           # symbolic, reordered
    ("Total: \\boxed{1,000}", 1000),                                     # a numeric label
])
def test_equal_answers_score_one(reward, response: str, label: object) -> None:
    assert reward(_sample(response, label)) == 1.0


@pytest.mark.parametrize(("response", "label"), [
    ("So the answer is \\boxed{\\frac{1}{3}}.", "\\frac{1}{2}"),  # wrong
    ("I do not know.", "42"),                                     # no answer at all
    ("<think>it is \\boxed{42}", "42"),                           # only inside unfinished thinking
    ("\\boxed{42}", None),                                        # no label
])
def test_wrong_or_missing_answers_score_zero(reward, response: str, label: object) -> None:
    assert reward(_sample(response, label)) == 0.0


def test_unparseable_label_is_an_error_not_a_zero(reward) -> None:
    group = [_sample("\\boxed{1}", "\\frac{")]
    error = asyncio.run(score_group(group, reward))
    assert error is not None and "could not parse the label" in error
    assert group[0].reward is None


def test_works_off_the_main_thread(reward) -> None:
    """SIGALRM timeouts only work on the main thread; elsewhere the reward still grades."""
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(reward(_sample("\\boxed{6/4}", "1.5"))))
    t.start()
    t.join(60)
    assert out == [1.0]


def test_setting_accepts_the_name(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", "1",
             "--rollout-batch-size", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run")]
    assert load_config(None, [*flags, "--reward-fn", "math_verify"]).reward_fn == "math_verify"
    with pytest.raises(ConfigError, match="math_verify"):  # the refusal lists it among builtins
        load_config(None, [*flags, "--reward-fn", "math_verify2"])


def test_missing_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # None in sys.modules: ImportError
    with pytest.raises(ValueError, match=r"reward_fn: .*pip install 'milepost\[math\]'") as e:
        load_reward_fn("math_verify")
    assert isinstance(e.value.__cause__, MissingExtraError)
