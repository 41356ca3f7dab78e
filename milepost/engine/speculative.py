"""Speculative decoding in the engine step, exact for RL: propose, verify in one forward, roll back.

Before the forward, each decode chunk of an eligible request gets up to k proposed tokens (n-gram
lookup or a draft model) and becomes a verify chunk: the target computes the last token and the
proposals in one pass over the paged KV and returns a row of logits per position. The verifier
(speculative_sampling.py) keeps the longest prefix the rejection-sampling rule accepts plus one
token of its own, so outputs follow the target's distribution exactly (greedy: the same tokens);
log-probs are the target's. Rejected positions are rolled back by not counting them
(`num_computed`): their KV slots are overwritten by the next step, and the routed experts recorded
beside them too. Requests whose settings read the output token by token (penalties, logit_bias, a
grammar, min_new_tokens not reached yet) decode without proposals in the same step: exact as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from milepost.engine.draft_model import DraftModel
from milepost.engine.draft_mtp import MtpDrafter
from milepost.engine.draft_ngram import NgramDrafter
from milepost.engine.request import Request
from milepost.engine.sampling import _on_device
from milepost.engine.scheduler import Chunk
from milepost.engine.speculative_pace import RestPace
from milepost.engine.speculative_sampling import Verdict, launch_verify

if TYPE_CHECKING:
    from milepost.engine.engine import Engine
    from milepost.engine.runner import ModelRunner

Drafter = NgramDrafter | DraftModel | MtpDrafter


@dataclass
class SpecStats:
    """Counters for the acceptance length (tokens per verify, the target's own one included)."""

    verify_rows: int = 0  # request-steps that verified proposals
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens those request-steps appended (accepted + 1, less any past a stop)
    rested_steps: int = 0  # n-gram back-off: decode steps run without proposing (speculative_pace.py)
    by_position: list[int] = field(default_factory=list)  # accepted counts per proposal index

    @property
    def accept_length(self) -> float:
        """Mean tokens per verified request-step: 1 + accepted proposals."""
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class Speculator:
    # Resting (speculative_pace.py): only the n-gram drafter rests (a draft model or MTP layer
    # must see every step), and only with the overlap schedule on (`can_rest`): a resting step is
    # a plain decode step launched ahead. It rests after a step that proposed nothing (at 256
    # requests on an H200 such steps ran 0.43x plain decoding) and, measured, while speculative
    # steps emit fewer tokens a second than plain ones; the index catches up during the rest (`catch_up`).

    def __init__(self, num_draft_tokens: int, drafter: Drafter, can_rest: bool = False,
                 measured_rest: bool = True) -> None:
        """num_draft_tokens: SGLang's count, the verified last token included (k + 1)."""
        if num_draft_tokens < 2:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2 (the last token plus at "
                             f"least one proposal); got {num_draft_tokens}")
        self.k = num_draft_tokens - 1
        self.drafter = drafter
        self.stats = SpecStats()
        self.can_rest = can_rest
        self.pace = RestPace(measured_rest)

    def resting(self) -> bool:
        """Whether the next decode step runs without proposals (and may be overlapped)."""
        return self.can_rest and self.pace.resting()

    def step_begins(self) -> None:
        """Before each engine step: the speculative step just done is timed (it may start a rest)."""
        if self.can_rest:
            self.pace.step_begins()

    def scheduled(self) -> None:
        """A proposing step is about to be scheduled, every queued step applied."""
        if self.can_rest:
            self.pace.scheduled()

    def stepped(self, start: float, tokens: int, verified: bool, rested: bool) -> None:
        """A step that began (resting) or was scheduled (verifying) at `start` sampled `tokens`."""
        if not self.can_rest:
            return
        if verified:
            self.pace.verified(start, tokens)
        elif rested:
            self.pace.rested(start, tokens)
            self.stats.rested_steps += 1

    @staticmethod
    def eligible(req: Request) -> bool:
        """The request's next tokens do not depend on the output token by token."""
        return (not req.adjusts_logits and req.grammar is None
                and len(req.output_ids) >= req.params.min_new_tokens)

    def attach(self, chunks: list[Chunk], engine: Engine) -> None:
        """Turn eligible decode chunks into verify chunks carrying their proposals (in place)."""
        picked: list[tuple[Chunk, int]] = []
        for c in chunks:
            req = c.req
            if c.length != 1 or not c.samples or not self.eligible(req):
                continue
            # Room left: every accepted token and the target's own one must fit the request.
            k = min(self.k, req.params.max_new_tokens - len(req.output_ids) - 1,
                    engine.cfg.context_length - req.total_len - 1)
            if k <= 0:
                continue
            if not engine.scheduler.reserve(req, req.total_len + k):
                k = len(req.blocks) * engine.cfg.block_size - req.total_len  # what the blocks hold
            if k > 0:
                picked.append((c, k))
        if not picked:
            return
        if isinstance(self.drafter, NgramDrafter):
            proposals = [(self.drafter.propose(c.req, k), None) for c, k in picked]
        else:
            proposals = self.drafter.propose([c.req for c, _ in picked], [k for _, k in picked])
        for (c, _), (tokens, probs) in zip(picked, proposals):
            if tokens:
                c.draft = tokens
                c.verify = True
                c.length = 1 + len(tokens)
                c.draft_probs = probs  # read back by `finish`
        if self.can_rest:
            self.pace.proposed(any(tokens for tokens, _ in proposals))

    def catch_up(self, running: list[Request]) -> None:
        """A resting step's forward is launched: the n-gram index takes the running requests'
        tokens now, while the GPU computes, not all at the next proposing step."""
        if isinstance(self.drafter, NgramDrafter):
            self.drafter.catch_up([r for r in running if self.eligible(r)])

    def finished(self, req: Request) -> None:
        """A request ended: an n-gram store keeps its last tokens for its siblings."""
        if isinstance(self.drafter, NgramDrafter):
            self.drafter.record_finished(req)

    def observe(self, chunks: list[Chunk], runner: ModelRunner) -> None:
        """After the target's forward: an MTP draft keeps the hidden states it reads."""
        if isinstance(self.drafter, MtpDrafter) and runner.last_hidden is not None:
            hidden, starts = runner.last_hidden
            runner.last_hidden = None
            self.drafter.observe(chunks, hidden, starts, self.eligible)

    def finish(self, engine: Engine, chunks: list[Chunk], logits: torch.Tensor) -> int:
        """Sample the step's plain chunks, verify its verify chunks and append their tokens.

        chunks: the step's sampling chunks in logits order. Returns the tokens appended."""
        plain_rows, spec_rows, plain, spec = [], [], [], []
        off = 0
        for c in chunks:
            (spec_rows if c.verify else plain_rows).extend(range(off, off + c.logit_rows))
            (spec if c.verify else plain).append(c)
            off += c.logit_rows
        appended = 0
        launched = pending = None
        if plain:
            from milepost.engine.stepping import LaunchedStep

            reqs = [c.req for c in plain]
            rows = logits if not spec else logits[_on_device(plain_rows, logits.device)]
            launched = LaunchedStep.of(reqs, engine._sample(rows, reqs), engine.weight_version)
        if spec:
            # Queued before the plain rows are read back (that read waits for the forward): the
            # verifier's host work then runs beside the forward, not after it.
            rows = logits if not plain else logits[_on_device(spec_rows, logits.device)]
            pending = launch_verify(rows, [c.draft for c in spec], [c.draft_probs for c in spec],
                                    [c.req.params for c in spec], [c.req.generator for c in spec])
        if launched is not None:
            engine._process(launched)
            appended += len(plain)
        if pending is not None:
            verdict = pending.result()
            for i, c in enumerate(spec):
                appended += self._apply(engine, c, verdict, i)
        return appended

    def _apply(self, engine: Engine, c: Chunk, verdict: Verdict, i: int) -> int:
        """Append request i's accepted proposals and final token one by one (a stop ends it)."""
        from milepost.engine.stepping import _HostSample

        req = c.req
        start_len = req.total_len
        tokens, rows = verdict.tokens[i], verdict.rows[i]
        top_ids = top_lp = ids_lp = None
        lp_all = verdict.logprobs_all
        if req.return_logprob and req.top_logprobs_num > 0:
            top_lp, top_ids = lp_all[rows].topk(min(req.top_logprobs_num, lp_all.shape[1]), dim=-1)
        if req.return_logprob and req.token_ids_logprob:
            cols = torch.tensor(req.token_ids_logprob, dtype=torch.long, device=lp_all.device)
            ids_lp = lp_all[rows][:, cols]
        host = _HostSample(tokens, verdict.logprobs[i], top_ids, top_lp, ids_lp)
        n = 0
        for j in range(len(tokens)):
            if j:  # the previous token was an accepted proposal: its KV (this forward's) is valid
                req.num_computed += 1
            engine._append_token(req, j, host, engine.weight_version, False)
            n += 1
            if req.is_finished:
                break
        m = verdict.accepted[i]
        req.spec_verify_ct += 1
        req.spec_num_proposed_drafts += len(c.draft)
        req.spec_num_correct_drafts += m
        if not isinstance(self.drafter, NgramDrafter):
            self.drafter.after_verify(req, start_len, len(c.draft), m)
        s = self.stats
        s.verify_rows += 1
        s.proposed += len(c.draft)
        s.accepted += m
        s.emitted += n
        while len(s.by_position) < len(c.draft):
            s.by_position.append(0)
        for j in range(m):
            s.by_position[j] += 1
        return n
