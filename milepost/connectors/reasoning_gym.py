"""reasoning-gym procedural tasks as a prompt source and verifier (`milepost[reasoning-gym]`).

`python -m milepost.connectors.reasoning_gym TASK --size N --seed S --out prompts.jsonl` writes a
prompt dataset made on the spot (seeded, no downloads); `--reward-fn
milepost.connectors.reasoning_gym:reward` scores each answer with the task's own scorer, on the
entry rebuilt from the row's metadata (task, seed, size, config, index). docs/environments.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from milepost.connectors.extras import MissingExtraError, require
from milepost.rollout.rewards import final_text
from milepost.types import Sample

META_KEY = "reasoning_gym"
SETTINGS = {"reward_fn": "milepost.connectors.reasoning_gym:reward"}  # what --env stands for

# Checked at import, which `--reward-fn milepost.connectors.reasoning_gym:reward` does at start:
# a run without the package is refused then, naming the extra (the package loads on first use).
if importlib.util.find_spec("reasoning_gym") is None:
    raise MissingExtraError("the reasoning-gym connector needs the 'reasoning_gym' package; "
                            "install it with: pip install 'milepost[reasoning-gym]'")


def _rg() -> Any:
    return require("reasoning_gym", "reasoning-gym", "the reasoning-gym connector")


@functools.lru_cache(maxsize=64)
def _dataset(task: str, seed: int, size: int, config_json: str) -> Any:
    try:
        return _rg().create_dataset(task, seed=seed, size=size, **json.loads(config_json))
    except (KeyError, ValueError, TypeError, AssertionError) as e:  # its configs assert
        raise ValueError(f"reasoning-gym task {task!r} with config {config_json}: {e}") from e


def dataset(task: str, *, seed: int, size: int, config: dict[str, Any] | None = None) -> Any:
    """The reasoning-gym dataset `task` (its own seeded generator; entries made on access)."""
    return _dataset(task, seed, size, json.dumps(config or {}, sort_keys=True))


FEW_SHOT_SEED_OFFSET = 1_000_003  # demonstrations come from another seed than the prompts


def prompt_rows(task: str, *, size: int, seed: int, config: dict[str, Any] | None = None,
                system_prompt: str = "default", few_shot: int = 0) -> list[dict[str, Any]]:
    """Dataset rows (`prompt` chat messages, `label`, `metadata`) of `size` entries of `task`.

    system_prompt: a name in reasoning_gym.utils.SYSTEM_PROMPTS (they ask for `<answer>` tags,
    which `reward` reads), or "" for none. few_shot: that many solved entries (made from seed +
    FEW_SHOT_SEED_OFFSET) go before the question as user / assistant turns whose reply is
    `<answer>ANSWER</answer>`: small models follow a shown format, not a described one.
    """
    if few_shot < 0:
        raise ValueError(f"few_shot {few_shot}: give 0 or more demonstrations")
    prompts = _rg().utils.SYSTEM_PROMPTS
    if system_prompt and system_prompt not in prompts:
        raise ValueError(f"system_prompt {system_prompt!r} is not one of {sorted(prompts)} (or '')")
    ds = dataset(task, seed=seed, size=size, config=config)
    system = [{"role": "system", "content": prompts[system_prompt]}] if system_prompt else []
    shots = dataset(task, seed=seed + FEW_SHOT_SEED_OFFSET, size=few_shot, config=config) \
        if few_shot else []
    demos = [m for e in shots for m in ({"role": "user", "content": e["question"]},
                                        {"role": "assistant", "content": f"<answer>{e['answer']}</answer>"})]
    meta = {"task": task, "seed": seed, "size": size, "config": config or {}}
    return [{"prompt": [*system, *demos, {"role": "user", "content": entry["question"]}],
             "label": str(entry["answer"]),
             "metadata": {META_KEY: {**meta, "index": i}}}
            for i, entry in enumerate(ds)]


def write_prompts(path: Path, task: str, **kwargs: Any) -> int:
    """Write `prompt_rows(task, **kwargs)` as JSONL (for `--prompt-data`); returns the row count."""
    rows = prompt_rows(task, **kwargs)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def reward(sample: Sample) -> float:
    """The task's own score of the response's last `<answer>...</answer>` (0.0 without one)."""
    meta = sample.metadata.get(META_KEY)
    if not isinstance(meta, dict):
        raise TypeError(f"sample has no metadata[{META_KEY!r}]; make the prompt data with "
                         "`python -m milepost.connectors.reasoning_gym` (keep --metadata-key)")
    ds = dataset(meta["task"], seed=meta["seed"], size=meta["size"], config=meta.get("config"))
    entry = ds[meta["index"]]
    text = final_text(sample.response)
    answer = None if text is None else _rg().utils.extract_answer(text)
    return float(ds.score_answer(answer, entry))


def reward_exact(sample: Sample) -> float:
    """1.0 when the task's scorer gives the answer full marks, else 0.0: the accuracy, for tasks
    whose scorer gives part marks to any answer that contains the right one (as reasoning-gym's
    default scorer does: "11" scores 0.5 against "1"), which a policy can learn to exploit."""
    return 1.0 if reward(sample) >= 1.0 else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m milepost.connectors.reasoning_gym",
                                description="Write a reasoning-gym task as milepost prompt data.")
    p.add_argument("task", help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    p.add_argument("--size", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="{}", help="the task's settings as JSON, e.g. '{\"min_terms\": 2}'")
    p.add_argument("--system-prompt", default="default")
    p.add_argument("--few-shot", type=int, default=0,
                   help="solved examples shown before each question as chat turns (default 0)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        config = json.loads(a.config)
    except ValueError as e:
        p.error(f"--config {a.config!r}: give a JSON object ({e})")
    if not isinstance(config, dict):
        p.error(f"--config {a.config!r}: give a JSON object, e.g. '{{\"min_terms\": 2}}'")
    try:
        n = write_prompts(a.out, a.task, size=a.size, seed=a.seed, config=config,
                          system_prompt=a.system_prompt, few_shot=a.few_shot)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {n} {a.task} prompts to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
