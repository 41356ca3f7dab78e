"""A dedicated evaluation fleet (report 2.2.4, table 3, "Dedicated fleet").

Engines of their own, started by trainer rank 0 beside the run (deviation: not by the launcher;
they are tied to rank 0's process and end with it), that never generate training data. For each
evaluation every engine loads the snapshot from disk under the version it measures, and each must
then report that version before a single eval request is sent: the score would otherwise mix
weights. The score itself passes the same checks as a shared-engine score (mean version equals
the step's, no request served by mixed versions). Runs as an `ExternalEvaluator` backend, so it is
asynchronous, bounded and recorded the same way. CPU only for now (GPUs need the launcher to
reserve devices for it).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from milepost.data.source import PromptItem
from milepost.eval.external import EvalSkipped
from milepost.eval.shared import evaluate_on_engines
from milepost.launch.process import ManagedProcess, free_port
from milepost.rollout.client import EngineClient, EngineError
from milepost.rollout.generate import SamplingSettings
from milepost.rollout.rewards import GroupRewardFn, RewardFn


class DedicatedFleet:
    def __init__(self, model_path: Path, num_engines: int, log_dir: Path,
                 items: Sequence[PromptItem], n_samples: int, sampling: SamplingSettings,
                 reward_fn: RewardFn | None, group_reward_fn: GroupRewardFn | None,
                 *, dtype: str = "float32", max_concurrency: int = 256) -> None:
        self.items = list(items)
        self.n_samples = n_samples
        self.sampling = sampling
        self.reward_fn = reward_fn
        self.group_reward_fn = group_reward_fn
        self.max_concurrency = max_concurrency
        self.engines: list[ManagedProcess] = []
        self.urls: list[str] = []
        # One snapshot on the fleet at a time: the evaluator runs up to --max-outstanding-evals
        # evaluations on threads of its own, and a second one loading its weights would have the
        # first's remaining requests served by them (its score then skipped as mixed versions).
        self._one_at_a_time = threading.Lock()
        try:
            for i in range(num_engines):
                port = free_port()
                cmd = [sys.executable, "-m", "milepost", "serve", "--model-path", str(model_path),
                       "--host", "127.0.0.1", "--port", str(port), "--weight-version", "0",
                       "--device", "cpu", "--dtype", dtype, "--log-level", "warning"]
                self.engines.append(ManagedProcess(
                    f"eval engine {i}", cmd, Path(log_dir) / f"eval-engine-{i}.log",
                    f"http://127.0.0.1:{port}/health", env={"OMP_NUM_THREADS": "1"},
                    tied_to_parent=True))
                self.urls.append(f"http://127.0.0.1:{port}")
        except BaseException:
            self.close()
            raise

    def evaluate(self, checkpoint_dir: Path, prompt_data: Path, step: int) -> dict[str, float]:
        with self._one_at_a_time:
            return asyncio.run(self._evaluate(Path(checkpoint_dir), str(step + 1)))

    async def _evaluate(self, snapshot: Path, version: str) -> dict[str, float]:
        clients = [EngineClient(url) for url in self.urls]
        try:
            for url, c in zip(self.urls, clients):
                try:
                    await c.update_weights_from_disk(str(snapshot), weight_version=version)
                except EngineError as e:
                    raise EvalSkipped(f"eval engine {url} could not load the snapshot {snapshot}: "
                                      f"{e}") from e
            reported = [await c.get_weight_version() for c in clients]
            wrong = [f"{url} reports {v!r}" for url, v in zip(self.urls, reported) if v != version]
            if wrong:
                raise EvalSkipped(f"weight delivery not verified for version {version}: "
                                  + "; ".join(wrong))
            result = await evaluate_on_engines(
                clients, self.items, self.n_samples, self.sampling, self.reward_fn,
                self.group_reward_fn, expected_version=version,
                max_concurrency=self.max_concurrency)
        finally:
            for c in clients:
                await c.aclose()
        if result.skipped_reason is not None:
            raise EvalSkipped(result.skipped_reason)
        return result.metrics

    def close(self) -> None:
        for e in self.engines:
            e.close()
