"""One engine step: schedule, compute, sample, apply the tokens; and the overlap schedule.

`Stepper` is the part of `Engine` (engine.py) that runs on the engine thread for each step.
With the overlap schedule (SGLang's), a step's sampled tokens are left on the device: the next
step schedules and launches its successor first, feeding those tokens to the forward on the
device, and reads them back while that forward runs. The successor may be a mixed step (prompt
chunks of running requests, admissions from the queue) as long as nothing can be preempted;
penalties and grammars are applied when it samples, after the queued tokens are. Anything else,
and every inbox task but a submission, first applies the queued results. A request that samples
a stop token decodes one more token in the step already launched; that token is dropped."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from milepost.engine.grammar import fill_masks
from milepost.engine.prompt_logprobs import take_prompt_logprobs
from milepost.engine.request import ReqState, Request
from milepost.engine.sampling import SampleResult, sample
from milepost.engine.scheduler import Chunk

if TYPE_CHECKING:
    from milepost.engine.cuda_graph import Feed
    from milepost.engine.speculative import Speculator

PENDING_TOKEN = -1  # an output slot whose token is still on the device (overlap schedule)


class Stepper:
    """Mixed into Engine: uses its scheduler, runner, cfg, pool, stats, tokenizer, weight
    version, and its _finish / _emit / _emit_routed."""

    # Mixed steps (prompt chunks, admissions) queued ahead too; off: only all-decode steps of the
    # same requests, as before (a class switch so benchmarks/overlap_mixed_ab.py can time both).
    overlap_mixed: ClassVar[bool] = True
    _launched: LaunchedStep | None = None
    speculator: Speculator | None = None  # speculative decoding (speculative.py); set by setup

    def step(self) -> None:
        """One forward pass (`_step`), then the finished requests whose routed experts reached
        the host are emitted (all of them once the engine has no more work)."""
        self._step()
        self._emit_routed(wait=not self.scheduler.has_work)

    def _step(self) -> None:
        """One forward pass: schedule chunks, compute, sample, finish what is done.

        With the overlap schedule a step whose sampling is plain is left queued on the device:
        the next call schedules and launches its successor first, feeding it the sampled tokens
        on the device, and reads the queued results while that forward runs (SGLang's overlap
        scheduler), so per-request host work hides behind GPU work. That holds for mixed steps
        too: prompt chunks of running or newly admitted requests ride along.
        """
        t0 = time.perf_counter()
        spec = self.speculator
        if spec is not None:
            spec.step_begins()
        proposing = spec is not None and not spec.resting()
        prev, feed, start = None, None, t0  # start: when speculative_pace.py times the step from
        if self._launched is not None and not proposing and self._can_overlap(self._launched):
            prev, self._launched = self._launched, None
            chunks, feed = self._schedule_ahead(prev)
        else:
            self._flush()
            if proposing:
                spec.scheduled()
                start = time.perf_counter()  # after any queued plain step was applied
            chunks = self.scheduler.schedule()
        if not chunks:
            if prev is not None:
                self._process(prev, pending=True)
            return
        if proposing:  # proposals turn decode chunks into verify chunks
            spec.attach(chunks, self)
        logits = self.runner.forward(chunks, feed)
        if spec is not None:  # an MTP draft reads the target's hidden states
            spec.observe(chunks, self.runner)
        self.scheduler.after_forward(chunks)
        if spec is not None and not proposing:  # host work while the GPU runs the forward
            spec.catch_up(self.scheduler.running)
        if prev is not None:  # read back while the GPU runs the forward just launched
            self._process(prev, pending=True)
        scoring = not all(c.req.logprob_start_len < 0 for c in chunks)  # usually False: one pass
        if scoring:
            logits = take_prompt_logprobs(chunks, logits)
        for c in chunks if scoring else ():  # requests for 0 new tokens end once scored
            req = c.req
            if req.tokens_to_compute == 0 and req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
        sampling = [c.req for c in chunks if c.samples]
        n_sampled = len(sampling)
        verified = sampling and spec is not None and any(c.verify for c in chunks)
        if verified:
            n_sampled = spec.finish(self, [c for c in chunks if c.samples], logits)
        elif sampling:
            launched = LaunchedStep.of(sampling, self._sample(logits, sampling), self.weight_version)
            if self.cfg.overlap_schedule and not scoring and (
                    self.overlap_mixed or all(c.length == 1 for c in chunks)):
                self._launched = launched
            else:
                self._process(launched)
        if spec is not None:
            spec.stepped(start, n_sampled, verified=bool(verified), rested=not proposing)
        self.stats.record_step(chunks, n_sampled, time.perf_counter() - t0)

    def _schedule_ahead(self, prev: LaunchedStep) -> tuple[list[Chunk], Feed | None]:
        """The next step's chunks while prev's tokens are still on the device: each of prev's
        live requests gets a slot for its token (filled by `_process`) and decodes it, fed on
        the device; other requests' prompt chunks and admissions are scheduled as usual."""
        live = [r for r in prev.sampling if not r.is_finished]
        for req in live:  # prev's token: a slot now, its value still on the device
            req.output_ids.append(PENDING_TOKEN)
        running = self.scheduler.running
        # Requests prev's token ends by length are not scheduled again (stop tokens cannot be
        # foreseen: such a request decodes one extra token, which is dropped).
        ending = [r for r in running if self._out_of_room(r)]
        for r in ending:
            running.remove(r)
        chunks = self.scheduler.schedule()
        running.extend(ending)
        row = {id(r): i for i, r in enumerate(prev.sampling)}
        dest, src, offset = [], [], 0
        for c in chunks:
            i = row.get(id(c.req))
            if i is not None:  # prev sampled its last token: always a one-token decode chunk
                assert c.length == 1 and c.start == c.req.total_len - 1, "a pending token misplaced"
                dest.append(offset)
                src.append(i)
            offset += c.length
        return chunks, (prev.result.tokens, dest, src) if dest else None

    def _can_overlap(self, prev: LaunchedStep) -> bool:
        """The next step can be scheduled before prev's tokens are known: no preemption can
        happen (every decode finds free blocks; prompt chunks and admissions never preempt).
        Penalties and grammar masks read prev's tokens only when the next step samples, after
        `_process(prev)` has applied them (step), so their requests run ahead too."""
        if self.paused is not None:
            return False
        live = [r for r in prev.sampling if not r.is_finished]
        s = self.scheduler
        if not self.overlap_mixed and (s.waiting or len(s.running) != len(live)):
            return False
        if any(r.state is not ReqState.RUNNING for r in live):
            return False
        fed = {id(r) for r in live}
        bs, need = self.cfg.block_size, 0
        for r in s.running:
            n = r.total_len + (id(r) in fed)  # its length once prev's token has a slot
            if r.state is ReqState.RUNNING and r.num_computed == n - 1:  # decodes next step
                need += max(0, -(-n // bs) - len(r.blocks))
        return need <= self.pool.num_free

    def _out_of_room(self, req: Request) -> bool:
        return (len(req.output_ids) >= req.params.max_new_tokens
                or req.total_len >= self.cfg.context_length)

    def _flush(self) -> None:
        """Read back and apply a step left queued by the overlap schedule, if any."""
        if self._launched is not None:
            prev, self._launched = self._launched, None
            self._process(prev)

    def _sample(self, logits: torch.Tensor, sampling: list[Request]) -> SampleResult:
        params = [r.params for r in sampling]
        banned = [self._banned(r) for r in sampling]
        masks = None
        # (a request the queued step just finished decodes one token more, dropped: its grammar
        # may be complete, so no mask is asked of it)
        rows = [i for i, r in enumerate(sampling) if r.grammar is not None and not r.is_finished]
        if rows:  # computed on the host while the device runs the forward just launched
            masks = (rows, fill_masks([sampling[i].grammar for i in rows],
                                      [banned[i] for i in rows], logits.shape[-1]))
            for i in rows:
                banned[i] = []  # in the mask already
        return sample(
            logits,
            params,
            [r.generator for r in sampling],
            banned,
            max(r.top_logprobs_num for r in sampling),
            # penalties read the output so far; without them no per-row lists are passed
            outputs=[r.output_ids for r in sampling]
            if any(r.adjusts_logits for r in sampling) else None,
            token_ids=[r.token_ids_logprob for r in sampling]
            if any(r.token_ids_logprob for r in sampling) else None,
            masks=masks,
            fused=self.cfg.fused_sampler,
        )

    def _process(self, launched: LaunchedStep, pending: bool = False) -> None:
        """Append each sampled token (pending: fill the slot reserved for it) and finish."""
        host = launched.read_back()
        for i, req in enumerate(launched.sampling):
            if req.is_finished:  # ended (stop token, abort) while this step was queued
                continue
            self._append_token(req, i, host, launched.version, pending)

    def _append_token(self, req: Request, row: int, result: _HostSample, version: str,
                      pending: bool) -> None:
        token = result.tokens[row]
        if pending:
            assert req.output_ids[-1] == PENDING_TOKEN, "the overlap schedule lost a token slot"
            req.output_ids[-1] = token
        else:
            req.output_ids.append(token)
        req.output_versions.append(version)
        if req.return_logprob:
            req.output_logprobs.append(result.logprobs[row])
            if req.top_logprobs_num > 0:
                k = req.top_logprobs_num
                req.output_top_logprobs.append(
                    list(zip(result.top_logprobs[row, :k].tolist(), result.top_ids[row, :k].tolist()))
                )
            if req.token_ids_logprob:
                req.output_ids_logprobs.append(
                    result.ids_logprobs[row, : len(req.token_ids_logprob)].tolist())
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.grammar is None:
            reason = self._finish_reason(req, token)
        else:
            reason = self._grammar_reason(req, token)
        if reason is not None:
            self._finish(req, reason)
        elif req.stream and len(req.output_ids) - req.emitted >= (req.params.stream_interval or 1):
            self._emit(req)

    def _finish_reason(self, req: Request, token: int) -> dict | None:
        p = req.params
        if token in req.stop_ids:
            return {"type": "stop", "matched": token}
        if p.stop and self.tokenizer is not None:
            longest = max(len(s) for s in p.stop)
            tail = self.tokenizer.decode(req.output_ids[-(4 * longest + 4):])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if p.stop_regex and self.tokenizer is not None:
            # The whole output: a pattern's match has no length bound (costs only who asks).
            text = self.tokenizer.decode(req.output_ids)
            for pattern in p.stop_regex:
                m = re.search(pattern, text)
                if m is not None:
                    return {"type": "stop", "matched": m.group(0)}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if req.total_len >= self.cfg.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _grammar_reason(self, req: Request, token: int) -> dict | None:
        """A grammar ends a request when it is complete and an end token was sampled (also under
        ignore_eos: nothing else is allowed then), as SGLang's grammar backends do."""
        verdict = req.grammar.accept(token)
        if verdict == "end":
            return {"type": "stop", "matched": token}
        if verdict is not None:  # a bug if it happens: the mask allows only what it accepts
            return {"type": "abort", "message": verdict}
        return self._finish_reason(req, token)

    def _banned(self, req: Request) -> list[int]:
        if len(req.output_ids) < req.params.min_new_tokens:
            return sorted(req.stop_ids)
        return []


@dataclass
class LaunchedStep:
    """A step whose sampled tokens may still be on the device (the overlap schedule).

    On CUDA the results are copied to pinned host memory as soon as they are sampled, with an
    event behind the copy: reading them back waits for that event only. A plain `.tolist()`
    would be a copy queued behind whatever was launched since, i.e. behind the next forward,
    which would serialize the two steps again.
    """

    sampling: list[Request]
    result: SampleResult  # on the device: the next step's forward reads its tokens there
    version: str  # the weights that computed it
    host: list[torch.Tensor | None]  # tokens, logprobs, top_ids, top_logprobs, ids_logprobs
    copied: torch.cuda.Event | None

    @classmethod
    def of(cls, sampling: list[Request], result: SampleResult, version: str) -> LaunchedStep:
        fields = [result.tokens, result.logprobs, result.top_ids, result.top_logprobs,
                  result.ids_logprobs]
        if result.tokens.device.type != "cuda":
            return cls(sampling, result, version, fields, None)
        host = [None if t is None else
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in fields]
        copied = torch.cuda.Event()
        copied.record()
        return cls(sampling, result, version, host, copied)

    def read_back(self) -> _HostSample:
        if self.copied is not None:
            self.copied.synchronize()
        tokens, logprobs, top_ids, top_logprobs, ids_logprobs = self.host
        return _HostSample(tokens.tolist(), logprobs.tolist(), top_ids, top_logprobs, ids_logprobs)


@dataclass
class _HostSample:
    tokens: list[int]
    logprobs: list[float]
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    ids_logprobs: torch.Tensor | None  # [B, K]: token_ids_logprob, padded per row
