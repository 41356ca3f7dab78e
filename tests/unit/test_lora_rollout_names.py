"""The fully-async rollout worker's engine clients name the run's LoRA adapter (`lora_path`),
as the sync loop's do: an engine with `--enable-lora` would otherwise sample the base."""

from __future__ import annotations

import pytest

from milepost.data.accounting import PromptLedger
from milepost.data.buffer import BufferSettings, GroupBuffer
from milepost.data.source import PromptDataset, PromptItem
from milepost.rollout import scheduler
from milepost.rollout.generate import SamplingSettings
from milepost.rollout.scheduler import RolloutWorker, WorkerSettings


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
