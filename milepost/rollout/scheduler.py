"""The background rollout worker of fully asynchronous RL (report section 2.2.1).

A thread runs an asyncio loop that keeps up to `max_inflight` trajectories generating. Each
drawn prompt becomes a group of `n_samples_per_prompt` trajectories on one engine (they share
its prefix cache). The replacement rule decides when a place frees: `sample` granularity frees a
trajectory's place as soon as it ends, `group` granularity only when the last trajectory of its
group ends; a new group starts once `n_samples_per_prompt` places are free. A finished group is
scored and put into the buffer; while a put waits for room (buffer full) no new group starts, so
a full buffer stops generation instead of piling finished groups up in memory.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from milepost.data.accounting import PromptLedger
from milepost.data.buffer import Buffer, BufferClosed
from milepost.data.source import PromptItem
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import SamplingSettings, generate_one
from milepost.rollout.layers import number_group
from milepost.rollout.rewards import GroupRewardFn, RewardFn, score_group
from milepost.types import Group, Sample, Status

log = logging.getLogger(__name__)
Granularity = Literal["group", "sample"]
# (engine client, prompt, index in its group, group index) -> the trajectory's sequences
TrajectoryFn = Callable[[EngineClient, PromptItem, int, int], Awaitable[list[Sample]]]


@dataclass(frozen=True)
class WorkerSettings:
    n_samples_per_prompt: int
    max_inflight: int
    granularity: Granularity = "sample"
    # Consecutive groups failing for a deterministic reason (reward error, engine refusal)
    # before the worker stops the run: going on would only drop every prompt.
    max_consecutive_failures: int = 16
    # LoRA RL: every request names the trained adapter (SGLang's lora_path); None = the base.
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if self.granularity not in ("group", "sample"):
            raise ValueError(f"granularity must be 'group' or 'sample', got {self.granularity!r}")
        if self.max_inflight < self.n_samples_per_prompt:
            raise ValueError(f"max_inflight {self.max_inflight} < n_samples_per_prompt "
                             f"{self.n_samples_per_prompt}: no group could ever start")


class InflightClock:
    """Time-weighted in-flight count and the time with nothing in flight, per interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # changed on the worker thread, read on the trainer's
        self.inflight = 0
        self._since = time.perf_counter()
        self._area = 0.0  # integral of inflight dt
        self._idle = 0.0  # seconds with inflight == 0
        self._span = 0.0

    def change(self, delta: int) -> None:
        with self._lock:
            self._advance()
            self.inflight += delta

    def _advance(self) -> None:
        now = time.perf_counter()
        dt = now - self._since
        self._area += self.inflight * dt
        self._idle += dt if self.inflight == 0 else 0.0
        self._span += dt
        self._since = now

    def read_and_reset(self) -> tuple[float, float]:
        """(mean trajectories in flight, seconds with none in flight) since the last call."""
        with self._lock:
            self._advance()
            mean = self._area / self._span if self._span > 0 else 0.0
            idle = self._idle
            self._area = self._idle = self._span = 0.0
            return mean, idle


class RolloutWorker:
    """Start with `start()`, stop with `stop()`; `error` holds what stopped it early, if anything."""

    def __init__(self, engine_urls: Sequence[str], ledger: PromptLedger, buffer: Buffer,
                 sampling: SamplingSettings, reward_fn: RewardFn | None,
                 group_reward_fn: GroupRewardFn | None, settings: WorkerSettings,
                 trajectory_fn: TrajectoryFn | None = None,
                 finish_group: Callable[[Group], Awaitable[str | None]] | None = None,
                 top_logprobs_num: int = 0) -> None:
        if not engine_urls:
            raise ValueError("RolloutWorker: no engine URLs")
        self.engine_urls = list(engine_urls)
        # One trajectory -> its sequences; None: one engine completion (agentic runs plug in
        # their layers here, rollout/agentic.py).
        self.trajectory_fn = trajectory_fn
        # A scored group -> None or why it cannot be trained on (a distillation teacher's pass,
        # rollout/teacher.py): such a group's prompt is retried.
        self.finish_group = finish_group
        self.top_logprobs_num = top_logprobs_num
        self.ledger = ledger
        self.buffer = buffer
        self.sampling = sampling
        self.reward_fn = reward_fn
        self.group_reward_fn = group_reward_fn
        self.settings = settings
        self.clock = InflightClock()
        self.error: BaseException | None = None
        # Groups drawn and not yet handed over (put into the buffer, or dropped as failed).
        self.groups_generating = 0
        self._count_lock = threading.Lock()
        self._task_error: BaseException | None = None
        self._free = settings.max_inflight
        self._putting = 0
        self._held = threading.Event()  # set: start no new group (shared-engine evaluation)
        self._failures = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="rollout-worker", daemon=True)
        self._started = threading.Event()

    # ---- life cycle (trainer thread) --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop starting groups, cancel the ones generating (their prompts stay outstanding).
        Closes the buffer first: a put waiting for room would otherwise never return."""
        self.buffer.close()
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop already ended (after an error)
                pass
        self._thread.join(timeout_s)

    def hold(self) -> None:
        """Start no new group until `release` (trajectories already generating go on)."""
        self._held.set()

    def release(self) -> None:
        self._held.clear()
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    def read_stats(self) -> dict[str, float]:
        mean, idle = self.clock.read_and_reset()
        return {"inflight_mean": mean, "engine_idle_time": idle,
                "groups_generating": float(self.groups_generating)}

    # ---- the loop (worker thread) -----------------------------------------------------------
    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # noqa: BLE001 - reported to the trainer through the buffer
            if not isinstance(e, BufferClosed):
                log.error("rollout worker stopped: %s: %s", type(e).__name__, e)
                self.error = e
        finally:
            self._started.set()
            self.buffer.close()  # a trainer waiting for a batch learns the worker is gone

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        changed = self._wake = asyncio.Event()
        clients = [EngineClient(url, lora_path=self.settings.lora_path) for url in self.engine_urls]
        tasks: set[asyncio.Task] = set()
        self._started.set()
        try:
            while not self._stop.is_set():
                while (self._free >= self.settings.n_samples_per_prompt and not self._putting
                       and not self._held.is_set()):
                    group_index, item = self.ledger.draw()
                    # Taken here, not in the task: the task runs only after this loop yields.
                    self._free -= self.settings.n_samples_per_prompt
                    with self._count_lock:
                        self.groups_generating += 1
                    client = clients[group_index % len(clients)]
                    task = asyncio.create_task(self._group(client, group_index, item, changed))
                    tasks.add(task)

                    def done(t: asyncio.Task) -> None:
                        tasks.discard(t)
                        if not t.cancelled() and t.exception() is not None:
                            self._task_error = self._task_error or t.exception()
                            changed.set()

                    task.add_done_callback(done)
                stop_wait = asyncio.ensure_future(self._stop.wait())
                change_wait = asyncio.ensure_future(changed.wait())
                await asyncio.wait({stop_wait, change_wait}, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                change_wait.cancel()
                changed.clear()
                if self._task_error is not None:
                    raise self._task_error
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.aclose()

    async def _group(self, client: EngineClient, group_index: int, item: PromptItem,
                     changed: asyncio.Event) -> None:
        n = self.settings.n_samples_per_prompt
        per_sample = self.settings.granularity == "sample"

        async def one(k: int) -> list[Sample]:
            self.clock.change(+1)
            try:
                if self.trajectory_fn is not None:
                    return await self.trajectory_fn(client, item, k, group_index)
                return [await generate_one(client, item, self.sampling, k,
                                           group_index=group_index,
                                           top_logprobs_num=self.top_logprobs_num)]
            finally:
                self.clock.change(-1)
                if per_sample:
                    self._free += 1
                    changed.set()

        try:
            group: Group = number_group(list(await asyncio.gather(*(one(k) for k in range(n)))))
        finally:
            if not per_sample:
                self._free += n
                changed.set()
        await self._deliver(group, changed)

    async def _deliver(self, group: Group, changed: asyncio.Event) -> None:
        """Score the group, then put it into the buffer (off the loop: put may block)."""
        failed = next((s.metadata["engine_error"] for s in group if "engine_error" in s.metadata),
                      None)
        if failed is None and not any(s.status is Status.ABORTED for s in group):
            failed = await score_group(group, self.reward_fn, self.group_reward_fn)
        teacher_failed = None
        if failed is None and self.finish_group is not None and not any(
                s.status is Status.ABORTED for s in group):
            teacher_failed = await self.finish_group(group)
        self._putting += 1
        try:
            if teacher_failed is not None:  # the teacher may answer later: the prompt is retried
                self.ledger.drop(group, "teacher", retry=True)
                self._handed_over()
                self._failures += 1
                if self._failures >= self.settings.max_consecutive_failures:
                    raise RuntimeError(f"{self._failures} groups in a row failed; last error: "
                                       f"{teacher_failed}")
            elif failed is not None:  # deterministic: trying again would fail the same way
                self.ledger.drop(group, "failed", retry=False)
                self._handed_over()
                self._failures += 1
                log.warning("fully async: a group failed and is dropped: %s", failed)
                if self._failures >= self.settings.max_consecutive_failures:
                    raise RuntimeError(f"{self._failures} groups in a row failed (reward function "
                                       f"or engine refusal); last error: {failed}")
            else:
                self._failures = 0

                def put() -> None:  # counted by the thread itself: a cancelled await may not see it
                    self.buffer.put(group)
                    self._handed_over()

                await asyncio.to_thread(put)
        finally:
            self._putting -= 1
            changed.set()

    def _handed_over(self) -> None:
        with self._count_lock:
            self.groups_generating -= 1
