"""The engine loop: one thread that owns the model, the KV cache and the scheduler.

Everything that touches model state (steps, weight updates, pause/continue, cache flushes) runs
on this thread, between steps, so a weight update never lands in the middle of a forward pass.
Other threads talk to it through `submit`, `abort` and `call` (a function run between steps).
Pause modes follow SGLang: abort ends in-flight requests; retract drops their KV and requeues
them, so they are recomputed and continue under the new weights; in_place freezes them with
their KV. Each output token records the weight version that sampled it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from milepost.engine.block_pool import BlockPool
from milepost.engine.radix_cache import RadixCache
from milepost.engine.request import ReqState, Request, RequestOutput
from milepost.engine.runner import ModelRunner, RoutedCopy
from milepost.engine.scheduler import Chunk, Scheduler
from milepost.engine.stats import EngineStats
from milepost.engine.stepping import LaunchedStep, Stepper
from milepost.onpolicy.contract import rescore_request as rescore

log = logging.getLogger(__name__)
T = TypeVar("T")
PauseMode = Literal["abort", "retract", "in_place"]


@dataclass
class EngineConfig:
    block_size: int
    num_blocks: int
    chunked_prefill_size: int
    max_running_requests: int
    context_length: int
    enable_prefix_cache: bool = True
    weight_version: str = "default"
    random_seed: int = 0
    overlap_schedule: bool = False  # leave decode steps queued; read them back behind the next
    true_on_policy: bool = False  # re-score finished sequences with the trainer's computation
    fused_sampler: bool = False  # temperature-only batches through kernels/fused_sampler.py


class Engine(Stepper):
    def __init__(self, runner: ModelRunner, tokenizer: object | None, cfg: EngineConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.pool = BlockPool(cfg.num_blocks)
        self.cache = RadixCache(self.pool, cfg.block_size) if cfg.enable_prefix_cache else None
        self.scheduler = Scheduler(
            self.pool, self.cache, cfg.block_size, cfg.chunked_prefill_size,
            cfg.max_running_requests, copy_kv=runner.copy_kv if self.cache is not None else None,
        )
        self.weight_version = cfg.weight_version
        self.paused: PauseMode | None = None
        self.stats = EngineStats()
        self._by_rid: dict[str, Request] = {}
        self._generator = torch.Generator(device=runner.device).manual_seed(cfg.random_seed)
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="milepost-engine", daemon=True)
        self.error: BaseException | None = None
        self._closers: list[Callable[[], None]] = []
        self._launched: LaunchedStep | None = None  # a step queued ahead (overlap schedule)
        self._routed_waiting: list[tuple[Request, RoutedCopy]] = []  # finished, not yet emitted

    # ---- thread-safe API -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def on_close(self, fn: Callable[[], None]) -> None:
        """Register cleanup (e.g. open weight groups) to run when the engine closes."""
        self._closers.append(fn)

    def close(self) -> None:
        for fn in self._closers:
            fn()
        self._stopping = True
        self._inbox.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, req: Request) -> None:
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(
                req.params.sampling_seed
            )
        else:
            req.generator = self._generator
        task = lambda: self._add(req)  # noqa: E731
        task.keeps_queued_step = True  # admitting reads no step's results (see _drain_inbox)
        self._inbox.put(task)

    def abort(self, rid: str | None, message: str = "aborted by request") -> None:
        """Abort one request by id, or every request when rid is None."""
        self._inbox.put(lambda: self._abort(rid, message))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the engine thread between steps; its result or exception lands in the future."""
        fut: Future[T] = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    if self.error is not None:  # model state after a crash is unknown
                        raise RuntimeError(f"the engine loop crashed: {self.error!r}")
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

        self._inbox.put(run)
        return fut

    # ---- engine-thread operations (use through `call`) --------------------------------------
    def pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self.abort_all("generation paused with mode abort")
        elif mode == "retract":
            self.scheduler.retract_all()
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def abort_all(self, message: str) -> None:
        """End every queued and running request; the pause state is left as it is (an update
        with abort_all_requests must not resume a server the trainer paused)."""
        self._abort(None, message)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running."""
        if self.scheduler.has_work:
            return False
        if self.cache is not None:
            self.cache.reset()
        return True

    def after_weight_update(self, weight_version: str | None, flush_cache: bool) -> None:
        """Record the new version; drop cached prefixes computed with the old weights."""
        if weight_version is not None:
            self.weight_version = weight_version
        if flush_cache and self.cache is not None:
            self.cache.reset()

    # ---- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                idle = self.paused is not None or not self.scheduler.has_work
                self._drain_inbox(block=idle)
                if self.paused is None and self.scheduler.has_work:
                    self.step()
        except BaseException as e:  # the server reports it on /health
            log.exception("engine loop crashed")
            self.error = e
            self._serve_after_crash()

    def _serve_after_crash(self) -> None:
        """End every request, then keep answering the inbox (new requests are aborted, calls
        fail) until close: a dead loop that stopped reading would leave every caller hanging."""
        self._launched = None
        waiting, self._routed_waiting = [r for r, _ in self._routed_waiting], []
        for req in waiting + list(self._by_rid.values()):
            # Not `_finish`: scheduler and pool may be half-updated; only tell the owner.
            req.finish_reason = {"type": "abort", "message": f"engine error: {self.error}"}
            req.state = ReqState.FINISHED
            self._emit(req)
        self._by_rid.clear()
        while not self._stopping:
            self._drain_inbox(block=True)

    def _drain_inbox(self, block: bool) -> None:
        try:
            task = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                # Tasks (aborts, updates, pauses, calls) see every step's results applied; a
                # submission only queues its request, which the step launched ahead can admit.
                keeps = self.overlap_mixed and getattr(task, "keeps_queued_step", False)
                if self.error is None and not keeps:
                    self._flush()
                task()
                task = self._inbox.get_nowait()
        except queue.Empty:
            pass
        if self.error is None:  # idle or paused: no step will come to emit them
            self._emit_routed(wait=self.paused is not None or not self.scheduler.has_work)

    # ---- request bookkeeping ------------------------------------------------------------------
    def _add(self, req: Request) -> None:
        if self.error is not None:
            req.on_output(_abort_output(req, f"engine error: {self.error}"))
            return
        if req.rid in self._by_rid:
            self._flush()  # the step queued ahead may have finished it
        if req.rid in self._by_rid:
            req.on_output(_abort_output(req, f"duplicate rid {req.rid!r}: already running"))
            return
        lora = self.runner.lora
        if req.lora_name is not None and (lora is None or req.lora_name not in lora.loaded):
            req.on_output(_abort_output(req, f"LoRA adapter {req.lora_name!r} is not loaded"))
            return
        if lora is not None and (why := lora.refusal(req.lora_name)) is not None:
            req.on_output(_abort_output(req, why))
            return
        self._by_rid[req.rid] = req
        if req.params.max_new_tokens == 0 and req.logprob_start_len < 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        self.scheduler.add(req)

    def abort_many(self, rids: list[str], message: str) -> None:
        """Abort these requests (unknown or finished ones are skipped) in one engine task."""
        self._inbox.put(lambda: self._abort_rids(rids, message))

    def abort_where(self, pred: Callable[[Request], bool], message: str) -> None:
        """Engine thread: abort every unfinished request for which pred(request) holds."""
        self._abort_rids([rid for rid, r in self._by_rid.items() if pred(r)], message)

    def _abort(self, rid: str | None, message: str) -> None:
        self._abort_rids(list(self._by_rid) if rid is None else [rid], message)

    def _abort_rids(self, rids: list[str], message: str) -> None:
        targets = [r for r in (self._by_rid.get(rid) for rid in rids)
                   if r is not None and not r.is_finished]
        if len(targets) > 1:
            self.scheduler.finish_many(targets)  # one pass over the queue; _finish then skips it
        for req in targets:
            self._finish(req, {"type": "abort", "message": message})

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        if self.cfg.true_on_policy and req.return_logprob and reason.get("type") != "abort":
            rescore(self.runner.model, req)
        routed = self.runner.routed_experts(req) if req.return_routed_experts else None
        if self.speculator is not None:
            self.speculator.finished(req)
        self.scheduler.finish(req)
        self._by_rid.pop(req.rid, None)
        self.stats.record_finish(req)
        if routed is None:
            self._emit(req)
        else:  # its routed experts are on their way to the host: emitted once there
            self._routed_waiting.append((req, routed))

    def _emit_routed(self, wait: bool) -> None:
        """Emit the finished requests whose routed experts reached the host, in finishing order;
        wait: all of them (the engine has nothing else to do). Their copies queue behind the step
        run ahead, so reading them at once would stall the overlap schedule."""
        left = []
        for req, copy in self._routed_waiting:
            if left or not (wait or copy.ready()):
                left.append((req, copy))
            else:
                self._emit(req, copy.base64())
        self._routed_waiting = left

    def _emit(self, req: Request, routed: str | None = None) -> None:
        a = req.emitted
        req.emitted = len(req.output_ids)
        req.on_output(
            RequestOutput(
                rid=req.rid,
                new_token_ids=req.output_ids[a:],
                new_logprobs=req.output_logprobs[a:],
                new_top_logprobs=req.output_top_logprobs[a:],
                new_weight_versions=req.output_versions[a:],
                new_ids_logprobs=req.output_ids_logprobs[a:] if req.token_ids_logprob else None,
                input_logprobs=req.input_logprobs if req.logprob_start_len >= 0 else None,
                prompt_ids=req.prompt_ids if req.logprob_start_len >= 0 else None,
                input_top_logprobs=req.input_top_logprobs,
                input_ids_logprobs=req.input_ids_logprobs,
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                finished=req.is_finished,
                finish_reason=req.finish_reason,
                routed_experts=routed,
                weight_version=self.weight_version,
                spec_counts=None if self.speculator is None else (
                    req.spec_verify_ct, req.spec_num_proposed_drafts, req.spec_num_correct_drafts),
            )
        )


def _abort_output(req: Request, message: str) -> RequestOutput:
    return RequestOutput(
        rid=req.rid, new_token_ids=[], new_logprobs=[], new_top_logprobs=[],
        new_weight_versions=[], prompt_tokens=len(req.prompt_ids), cached_tokens=0,
        finished=True, finish_reason={"type": "abort", "message": message},
    )


__all__ = ["Chunk", "Engine", "EngineConfig", "PauseMode"]
