"""SGLang's `/generate` response for one sequence, accumulated from the engine's output events.

Log-prob entries are `[logprob, token_id, text|None]`. Prompt log-probs (`input_token_logprobs`,
from `logprob_start_len` on, `null` for the first prompt token) come with `input_top_logprobs`
and `input_token_ids_logprobs` when asked, as SGLang returns them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from milepost.engine.protocol import Item
from milepost.engine.request import RequestOutput


@dataclass
class Result:
    """Accumulates a request's output events into SGLang's response."""

    rid: str
    item: Item
    return_text_in_logprobs: bool
    prompt_ids: list[int] | None = None  # returned when the client asked (return_prompt_token_ids)
    start: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    ids_logprobs: list[list[float]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    last: RequestOutput | None = None

    @property
    def return_logprob(self) -> bool:
        return self.item.return_logprob or self.item.top_logprobs_num > 0

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def add(self, out: RequestOutput) -> None:
        self.output_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top_logprobs += out.new_top_logprobs
        self.ids_logprobs += out.new_ids_logprobs or []
        self.versions += out.new_weight_versions
        self.last = out

    def text(self, tokenizer: object | None) -> str:
        """The output text; a matched stop string or stop token is cut off (unless no_stop_trim)."""
        if tokenizer is None:
            return ""
        p = self.item.params
        ids = self.output_ids
        matched = (self.last.finish_reason or {}).get("matched") if self.last else None
        if isinstance(matched, int) and not p.no_stop_trim and ids and ids[-1] == matched:
            ids = ids[:-1]  # SGLang trims a stop token's text too
        text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if isinstance(matched, str) and not p.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text

    def response(self, tokenizer: object | None) -> dict:
        out = self.last
        assert out is not None
        meta: dict = {
            "id": self.rid,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": out.cached_tokens,
            "weight_version": out.weight_version,
            "output_token_weight_versions": self.versions,
            "e2e_latency": time.perf_counter() - self.start,
        }
        if self.return_logprob:
            self._logprobs(meta, out, tokenizer)
        if out.routed_experts is not None:
            meta["routed_experts"] = out.routed_experts
        if out.spec_counts is not None:  # SGLang's names; accept length = 1 + correct / verify_ct
            meta["spec_verify_ct"], meta["spec_num_proposed_drafts"], meta["spec_num_correct_drafts"] = \
                out.spec_counts
        body = {"text": self.text(tokenizer), "output_ids": list(self.output_ids), "meta_info": meta}
        if self.prompt_ids is not None:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def _logprobs(self, meta: dict, out: RequestOutput, tokenizer: object | None) -> None:
        with_text = self.return_text_in_logprobs and tokenizer is not None

        def entry(lp: float | None, t: int) -> list:
            return [lp, t, tokenizer.decode([t]) if with_text else None]

        meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(self.logprobs, self.output_ids)]
        if self.top_logprobs:
            meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in row] for row in self.top_logprobs]
        ids = self.item.token_ids_logprob
        if ids:
            meta["output_token_ids_logprobs"] = [[entry(lp, t) for lp, t in zip(row, ids)]
                                                 for row in self.ids_logprobs]
        inputs = out.input_logprobs
        if inputs is None:  # logprob_start_len -1: no prompt log-probs were computed
            meta["input_token_logprobs"] = []
            return
        start = self.item.logprob_start_len
        prompt = out.prompt_ids or []
        meta["input_token_logprobs"] = [entry(lp, prompt[start + i]) for i, lp in enumerate(inputs)]
        if self.item.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if row is None else [entry(lp, t) for lp, t in row]
                for row in out.input_top_logprobs or []]
        if ids:
            meta["input_token_ids_logprobs"] = [
                None if row is None else [entry(lp, t) for lp, t in zip(row, ids)]
                for row in out.input_ids_logprobs or []]
