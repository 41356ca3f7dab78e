"""The engine clients of the fully-async rollout worker and of the rollout layers (custom generate /
agent fns) name the run's LoRA adapter (`lora_path`), as the sync loop's do: an engine with
`--enable-lora` would otherwise sample the base."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from milepost.data.accounting import PromptLedger
from milepost.data.buffer import BufferSettings, GroupBuffer
from milepost.data.source import PromptDataset, PromptItem
from milepost.config import load_config
from milepost.rollout import agentic, scheduler
from milepost.rollout.agentic import AgenticRollout
from milepost.rollout.generate import SamplingSettings
from milepost.rollout.scheduler import RolloutWorker, WorkerSettings
from milepost.testing.run_args import stub_run_args


@pytest.mark.parametrize("lora_path", ["policy", None])
def test_worker_clients_carry_the_adapter(monkeypatch: pytest.MonkeyPatch, lora_path: str | None) -> None:
    made: list[tuple[str, str | None]] = []

    class Recorder:  # stands in for EngineClient: records how it was made, then stops the worker
        def __init__(self, url: str, *args: object, lora_path: str | None = None, **kwargs: object) -> None:
            made.append((url, lora_path))
            raise RuntimeError("recorded")

    monkeypatch.setattr(scheduler, "EngineClient", Recorder)
    data = PromptDataset([PromptItem(0, "1+1=", [5, 6, 7])], seed=0)
    buffer = GroupBuffer(BufferSettings(capacity=2), lambda *a: None)
    worker = RolloutWorker(["http://127.0.0.1:9"], PromptLedger(data), buffer,
                           SamplingSettings(max_new_tokens=4), None, None,
                           WorkerSettings(2, 2, lora_path=lora_path))
    worker.start()  # returns once the worker thread has started (here: stopped)
    worker._thread.join(timeout=60)
    assert made == [("http://127.0.0.1:9", lora_path)]
    assert isinstance(worker.error, RuntimeError)


@pytest.mark.parametrize("lora", [["--lora-rank", "4"], []])
def test_rollout_layer_clients_carry_the_adapter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 lora: list[str]) -> None:
    made: list[str | None] = []

    class Recorder:
        def __init__(self, url: str, *args: object, lora_path: str | None = None, **kwargs: object) -> None:
            made.append(lora_path)
            raise RuntimeError("recorded")

    monkeypatch.setattr(agentic, "EngineClient", Recorder)
    cfg = load_config(None, stub_run_args(tmp_path, "--num-rollout", "1", "--rollout-batch-size", "1", "--device", "cpu",
                                          "--custom-generate-function-path",
                                          "milepost.rollout.layers:default_generate", *lora))
    layers = AgenticRollout(cfg, ["http://127.0.0.1:9"], None, SamplingSettings(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="recorded"):
        asyncio.run(layers.rollout([], 0, None, None))
    assert made == ["policy" if lora else None]
