"""The rollout side of multi-LoRA: each adapter's prompts, reward and metrics ([[lora.adapters]]).

`AdapterPrompts` is the run's data source: it draws every rollout batch from the adapters'
datasets in turn (equal shares, the remainder rotating), tags each prompt with its adapter
(`metadata["lora_adapter"]`, which the request's `lora_path` and the trainer's routing read) and
hands a requeued prompt back to its own dataset. `AdapterRewards` scores a sample with its
adapter's reward function, and also with every other adapter's (kept in the sample's metadata),
so the metrics show whether an adapter learns only its own task.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from milepost.data.source import PromptDataset, PromptItem
from milepost.lora.settings import SAMPLE_ADAPTER_KEY
from milepost.types import Group

CROSS_KEY = "lora_rewards"  # Sample.metadata: {adapter: that adapter's reward of this sample}


@dataclass(frozen=True)
class AdapterSpec:
    """One `[[lora.adapters]]` entry, resolved against the run's defaults."""

    name: str
    prompt_data: str
    reward_fn: str
    lr: float
    eval_prompt_data: str | None = None  # held-out prompts scored with this adapter: eval/<name>/...


def adapter_specs(entries: Sequence[dict[str, Any]], reward_fn: str, lr: float) -> list[AdapterSpec]:
    return [AdapterSpec(e["name"], str(e["prompt_data"]), str(e.get("reward_fn", reward_fn)),
                        float(e.get("lr", lr)), e.get("eval_prompt_data")) for e in entries]


def adapter_eval_items(specs: Sequence[AdapterSpec], tokenizer: Any, **kwargs: Any) -> dict[str, list[PromptItem]]:
    """Each adapter's eval prompts (those that name eval_prompt_data), in file order, tagged with
    the adapter: its requests name it and `AdapterRewards` scores them with its reward."""
    out = {}
    for spec in specs:
        if spec.eval_prompt_data is None:
            continue
        items = PromptDataset.from_file(spec.eval_prompt_data, tokenizer, shuffle=False, **kwargs).items
        for item in items:
            item.metadata = {**item.metadata, SAMPLE_ADAPTER_KEY: spec.name}
        out[spec.name] = items
    return out


class AdapterPrompts:
    """A DataSource over several adapters' prompt datasets (see the module docstring)."""

    def __init__(self, datasets: dict[str, PromptDataset]) -> None:
        self.datasets = datasets
        self.names = list(datasets)
        self.turn = 0  # which adapter gets the first of the remainder prompts next

    @classmethod
    def from_files(cls, specs: Sequence[AdapterSpec], tokenizer: Any, seed: int, **kwargs: Any) -> AdapterPrompts:
        datasets = {}
        for k, spec in enumerate(specs):
            data = PromptDataset.from_file(spec.prompt_data, tokenizer, seed=seed + k, **kwargs)
            for item in data.items:
                item.metadata = {**item.metadata, SAMPLE_ADAPTER_KEY: spec.name}
            datasets[spec.name] = data
        return cls(datasets)

    @property
    def items(self) -> list[PromptItem]:
        return [it for d in self.datasets.values() for it in d.items]

    def next_batch(self, n: int) -> list[PromptItem]:
        k = len(self.names)
        shares = [n // k] * k
        for j in range(n % k):
            shares[(self.turn + j) % k] += 1
        self.turn = (self.turn + n % k) % k
        return [it for name, m in zip(self.names, shares) if m for it in self.datasets[name].next_batch(m)]

    def requeue(self, items: Iterable[PromptItem]) -> None:
        for item in items:
            self.datasets[item.metadata[SAMPLE_ADAPTER_KEY]].requeue([item])

    def state_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "adapters": {n: d.state_dict() for n, d in self.datasets.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.turn = state["turn"]
        for name, s in state["adapters"].items():
            if name in self.datasets:  # an adapter added since the checkpoint starts fresh
                self.datasets[name].load_state_dict(s)


class AdapterRewards:
    """reward_fn(sample): its adapter's reward; every adapter's reward goes into metadata[CROSS_KEY]."""

    def __init__(self, fns: dict[str, Any]) -> None:
        self.fns = fns

    async def __call__(self, sample: Any) -> float:
        scores = {}
        for name, fn in self.fns.items():
            out = fn(sample)
            scores[name] = float(await out if inspect.isawaitable(out) else out)
        sample.metadata[CROSS_KEY] = scores
        return scores[sample.metadata[SAMPLE_ADAPTER_KEY]]


def adapter_metrics(groups: Sequence[Group], names: Sequence[str]) -> dict[str, float]:
    """Per adapter (no prefix; the driver adds `rollout/`): `<name>/reward_mean`, `<name>/num_samples`,
    `<name>/response_len_mean`, and `<name>/reward_of/<other>`: the mean reward that adapter
    `other`'s reward function gives this adapter's samples."""
    out: dict[str, float] = {}
    for name in names:
        samples = [s for g in groups for s in g if s.metadata.get(SAMPLE_ADAPTER_KEY) == name]
        if not samples:
            continue
        out[f"{name}/num_samples"] = float(len(samples))
        out[f"{name}/reward_mean"] = sum(float(s.reward or 0.0) for s in samples) / len(samples)
        out[f"{name}/response_len_mean"] = sum(s.response_length for s in samples) / len(samples)
        for other in names:
            scored = [s.metadata[CROSS_KEY][other] for s in samples if other in s.metadata.get(CROSS_KEY, {})]
            if other != name and scored:
                out[f"{name}/reward_of/{other}"] = sum(scored) / len(scored)
    return out
