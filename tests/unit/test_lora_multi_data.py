"""Multi-LoRA's rollout side: mixed prompt batches tagged by adapter, requeue to the right
dataset, resumable state, rewards by adapter with the cross-task scores, per-adapter metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from milepost.data.source import PromptDataset, PromptItem
from milepost.lora.demo_tasks import estimate_reward
from milepost.lora.multi_data import (
    AdapterPrompts,
    AdapterRewards,
    AdapterSpec,
    adapter_eval_items,
    adapter_metrics,
    adapter_specs,
)
from milepost.types import Sample


def _data(n: int, tag: str) -> PromptDataset:
    return PromptDataset([PromptItem(i, f"{tag}{i}", [1, i + 3]) for i in range(n)], seed=0)


def _prompts() -> AdapterPrompts:
    out = AdapterPrompts({"add": _data(5, "a"), "sub": _data(7, "s")})
    for name, d in out.datasets.items():  # as from_files tags them
        for it in d.items:
            it.metadata = {"lora_adapter": name}
    return out


def test_batches_mix_adapters_fairly_and_requeue_home() -> None:
    data = _prompts()
    first = data.next_batch(5)  # 3 + 2: the remainder goes to 'add' first, then rotates
    tags = [it.metadata["lora_adapter"] for it in first]
    assert tags == ["add"] * 3 + ["sub"] * 2
    second = data.next_batch(5)
    assert [it.metadata["lora_adapter"] for it in second] == ["add"] * 2 + ["sub"] * 3
    state = data.state_dict()
    data.requeue([first[0], first[3]])
    again = data.next_batch(2)
    assert {(it.metadata["lora_adapter"], it.prompt) for it in again} == {("add", first[0].prompt), ("sub", first[3].prompt)}
    resumed = _prompts()
    resumed.load_state_dict(state)
    nxt = [it.prompt for it in resumed.next_batch(4)]
    ref = _prompts()
    ref.next_batch(5), ref.next_batch(5)
    assert nxt == [it.prompt for it in ref.next_batch(4)]  # a resume continues where the run was


def test_rewards_by_adapter_and_metrics_per_adapter() -> None:
    rewards = AdapterRewards({"exact": lambda s: float(s.response == s.label), "estimate": estimate_reward})
    samples = [Sample(0, 0, tokens=[1, 2], response_length=1, response="68", label="68",
                      metadata={"lora_adapter": "exact"}),
               Sample(1, 0, tokens=[1, 2], response_length=1, response="~70", label="68",
                      metadata={"lora_adapter": "estimate"}),
               Sample(1, 1, tokens=[1, 2], response_length=1, response="68", label="68",
                      metadata={"lora_adapter": "estimate"})]
    for s in samples:
        s.reward = asyncio.run(rewards(s))
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0]
    m = adapter_metrics([samples[:1], samples[1:]], ["exact", "estimate"])
    assert m["exact/reward_mean"] == 1.0 and m["exact/reward_of/estimate"] == 0.0
    assert m["estimate/reward_mean"] == 0.5 and m["estimate/reward_of/exact"] == 0.5
    assert m["estimate/num_samples"] == 2.0


def test_specs_take_the_run_defaults() -> None:
    specs = adapter_specs([{"name": "a", "prompt_data": "p.jsonl"}, {"name": "b", "prompt_data": "q", "lr": 1e-3,
                                                                      "reward_fn": "math"}], "exact_match", 5e-4)
    assert [(s.name, s.reward_fn, s.lr) for s in specs] == [("a", "exact_match", 5e-4), ("b", "math", 1e-3)]


class _Tokenizer:
    """What PromptDataset.from_file uses of a tokenizer for plain-text prompts."""

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[ord(ch) for ch in text] for text in texts]}


def test_eval_items_per_adapter_in_file_order_tagged(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(5)))
    specs = [AdapterSpec("add", "unused", "math", 1e-3, str(path)), AdapterSpec("sub", "unused", "math", 1e-3)]
    items = adapter_eval_items(specs, _Tokenizer(), apply_chat_template=False)
    assert list(items) == ["add"]  # an adapter without eval_prompt_data is not evaluated
    assert [it.prompt for it in items["add"]] == [f"{i}+1=" for i in range(5)]  # not shuffled
    assert all(it.metadata["lora_adapter"] == "add" for it in items["add"])  # requests and reward name it
    assert adapter_specs([{"name": "a", "prompt_data": "p", "eval_prompt_data": "e"}], "math", 1.0)[0].eval_prompt_data == "e"
