"""Validation, tokenization and submission of generation requests, and SGLang's response.

Shared by `/generate` and the OpenAI routes. Each prompt of a body becomes one engine Request per
sample (`n`); `_Result` accumulates a request's output events into SGLang's response shape.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from milepost.engine.engine import Engine
from milepost.engine.generate_result import Result
from milepost.engine.grammar import Grammar, GrammarCompiler, GrammarError
from milepost.engine.protocol import GenerateReqInput, Item
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams


class BadRequest(Exception):
    """Client error: answered 400 with the message."""


class TooLarge(BadRequest):
    """A request over a size limit: answered 413 with the message."""


class EngineDown(Exception):
    """The engine loop has stopped: answered 503 (as /health is) instead of waiting forever."""


@dataclass(frozen=True)
class Names:
    """What the client called each input, so that error messages name the field it sent."""

    prompt: str = "input_ids"
    max_new_tokens: str = "sampling_params.max_new_tokens"
    stop_token_ids: str = "sampling_params.stop_token_ids"
    seed: str = "sampling_params.sampling_seed"
    logit_bias: str = "sampling_params.logit_bias"
    grammar: str = "sampling_params"  # where json_schema / regex / ebnf sit


SGLANG_NAMES = Names()
OPENAI_NAMES = Names(prompt="prompt", max_new_tokens="max_tokens", stop_token_ids="stop_token_ids",
                     seed="seed", logit_bias="logit_bias", grammar="response_format")

# How often a non-streaming request checks that its client is still there (SGLang does the same).
DISCONNECT_POLL_S = 1.0


@dataclass
class ServerInfo:
    model_path: str
    tokenizer_path: str | None
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    server_args: dict = field(default_factory=dict)


@dataclass
class Limits:
    """Per-request limits that keep one request from stalling the server (docs/engine.md)."""

    max_request_batch: int = 4096  # sequences (prompts x n) in one request
    chars_per_token: int = 32  # a text longer than context_length * this is refused untokenized


@dataclass
class Seq:
    """One sequence to generate: a prompt's ids, its settings (params with n=1) and its rid."""

    ids: list[int]
    item: Item
    rid: str
    index: int  # position in the response (prompt-major, then sample)
    grammar: Grammar | None = None  # structured output: this sequence's own matcher


class GenerateService:
    """Validates, tokenizes and submits generation requests; shared by SGLang and OpenAI routes."""

    def __init__(self, engine: Engine, info: ServerInfo, tokenizer: object | None,
                 limits: Limits | None = None, incremental_stream: bool = False) -> None:
        self.engine = engine
        self.info = info
        self.tokenizer = tokenizer
        self.limits = limits or Limits()
        self.incremental_stream = incremental_stream
        self.max_blocks = engine.cfg.num_blocks
        self.active: set[str] = set()  # rids submitted and not yet finished, for abort by prefix
        # Tokenizing runs here, off the event loop (a long text must not stall /health), one
        # job at a time (a shared fast tokenizer is not meant for concurrent calls).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="milepost-tokenize")
        engine.on_close(lambda: self._pool.shutdown(wait=False, cancel_futures=True))
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)
        engine.on_close(self.grammars.close)

    def tokenize(self, prompt: str | list[int], field: str = "text") -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequest(f"{field}: this model has no tokenizer; send input_ids instead")
            cap = self.info.context_length * self.limits.chars_per_token
            if len(prompt) > cap:
                raise BadRequest(
                    f"{field}: {len(prompt)} characters cannot fit the context length "
                    f"({self.info.context_length} tokens); texts over {cap} characters are refused "
                    "before tokenizing")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    async def tokenize_all(self, prompts: list[tuple[str | list[int], str]]) -> list[list[int]]:
        """tokenize() of each (prompt, field name), in the tokenizer thread when any is text."""
        if not any(isinstance(p, str) for p, _ in prompts):
            return [list(p) for p, _ in prompts]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: [self.tokenize(p, f) for p, f in prompts])


    def check(self, ids: list[int], params: SamplingParams, names: Names = SGLANG_NAMES) -> None:
        """Refuse what the engine cannot serve, naming the input at fault as the client sent it."""
        vocab = self.info.vocab_size
        if not ids:
            raise BadRequest(f"{names.prompt}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{names.prompt}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        # The engine bans stop ids by indexing the logits (min_new_tokens): an id outside the
        # vocabulary would crash its loop, a negative one would ban the wrong token.
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"{names.stop_token_ids}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        bad = [t for t in params.bias_ids() if t >= vocab]
        if bad:
            raise BadRequest(f"{names.logit_bias}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        seed = params.sampling_seed
        if seed is not None and not (-(2**63) <= seed and seed + params.n - 1 < 2**64):
            raise BadRequest(f"{names.seed}: {seed} (plus n-1) does not fit a 64-bit seed")
        total = len(ids) + params.max_new_tokens
        max_name = names.max_new_tokens.rsplit(".", 1)[-1]
        if total > self.info.context_length:
            raise BadRequest(
                f"{names.max_new_tokens}: prompt ({len(ids)} tokens) + {max_name} "
                f"({params.max_new_tokens}) exceeds the context length {self.info.context_length}"
            )
        need = -(-total // self.engine.cfg.block_size)
        if need > self.max_blocks:
            raise BadRequest(
                f"{names.max_new_tokens}: prompt + {max_name} need {need} KV blocks but the pool "
                f"has {self.max_blocks}; lower it or start the server with a larger --max-total-tokens"
            )

    def check_item(self, ids: list[int], item: Item, names: Names) -> None:
        """The per-prompt log-prob settings against the prompt and the vocabulary."""
        if item.return_logprob and item.logprob_start_len >= len(ids):
            raise BadRequest(f"logprob_start_len: {item.logprob_start_len} is not a position of "
                             f"{names.prompt} ({len(ids)} tokens); use 0 to {len(ids) - 1}, or -1")
        bad = [t for t in item.token_ids_logprob or [] if not 0 <= t < self.info.vocab_size]
        if bad:
            raise BadRequest(f"token_ids_logprob: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.info.vocab_size})")

    async def expand(self, body: GenerateReqInput, names: Names | None = None) -> list[Seq]:
        """One Seq per sequence to generate (prompts x n), validated; rids made unique.

        `names` name the inputs in messages (default: SGLang's, the prompt indexed in a batch).
        A rid already running, or given twice, is refused (SGLang refuses duplicate rids too).
        """
        try:
            items = body.items()
        except ValueError as e:
            raise BadRequest(str(e)) from e
        total = sum(item.params.n for item in items)
        if total > self.limits.max_request_batch:
            raise TooLarge(f"{'text' if body.text is not None else 'input_ids'}: {total} sequences "
                           f"(prompts x n) in one request; the limit is "
                           f"{self.limits.max_request_batch} (--max-request-batch): split the batch")
        if self.engine.error is not None:
            raise EngineDown(f"the engine stopped: {self.engine.error}")
        wheres = []
        for i in range(len(items)):
            where = names or replace(SGLANG_NAMES,
                                     prompt="text" if body.text is not None else "input_ids")
            wheres.append(replace(where, prompt=f"{where.prompt}[{i}]") if body.is_batch else where)
        all_ids = await self.tokenize_all([(it.prompt, w.prompt) for it, w in zip(items, wheres)])
        out: list[Seq] = []
        for item, ids, where in zip(items, all_ids, wheres):
            params = item.params
            if params.max_new_tokens is None:  # SGLang: null = up to the context length
                params = params.model_copy(update={
                    "max_new_tokens": max(0, self.info.context_length - len(ids))})
            self.check(ids, params, where)
            self.check_item(ids, item, where)
            self.check_lora(item.lora_path)
            start = item.logprob_start_len if item.return_logprob else -1
            base = item.rid or uuid.uuid4().hex
            grammars = await self._grammars(params, where)
            for j in range(params.n):
                seed = None if params.sampling_seed is None else params.sampling_seed + j
                one = params.model_copy(update={"n": 1, "sampling_seed": seed})
                rid = base if params.n == 1 else f"{base}-{j}"
                out.append(Seq(ids, replace(item, params=one, logprob_start_len=start), rid, len(out),
                               grammars[j] if grammars else None))
        rids = [s.rid for s in out]
        taken = next((r for r in rids if r in self.active), None)
        if taken is not None:
            raise BadRequest(f"rid: a request with rid {taken!r} is already running")
        if len(set(rids)) != len(rids):
            raise BadRequest("rid: the rids of a batch must be unique")
        return out

    def check_lora(self, name: str | None) -> None:
        """Refuse an adapter this engine does not hold (400 naming it); others keep being served."""
        if name is None:
            return
        pool = self.engine.runner.lora
        if pool is None:
            raise BadRequest(f"lora_path: {name!r}: this engine serves no LoRA adapters (start it "
                             "with --enable-lora)")
        if name not in pool.loaded:
            raise BadRequest(f"lora_path: adapter {name!r} is not loaded; loaded: {sorted(pool.loaded)} "
                             "(load it with POST /load_lora_adapter)")

    async def _grammars(self, params: SamplingParams, names: Names) -> list[Grammar] | None:
        """One compiled grammar per sample (n), compiled off the event loop; None: no grammar."""
        if params.grammar is None:
            return None
        field, text = params.grammar
        try:
            return await self.grammars.compile(field, text, params.n, names.grammar)
        except GrammarError as e:
            raise BadRequest(str(e)) from None

    def abort(self, rid: str) -> None:
        """Abort every request whose rid starts with `rid` (SGLang's rule: it also reaches the
        `rid-j` samples of an n>1 request)."""
        self.engine.abort_many([r for r in self.active if r.startswith(rid)] or [rid],
                               "aborted by request")

    def submit(self, seq: Seq, body: GenerateReqInput, stream: bool,
               ) -> tuple[Result, asyncio.Queue[RequestOutput]]:
        """Hand one sequence to the engine; its accumulator and output queue."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        item, params = seq.item, seq.item.params
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids.update(self.info.eos_token_ids)
        result = Result(seq.rid, item, body.return_text_in_logprobs,
                        prompt_ids=seq.ids if body.return_prompt_token_ids else None)
        self.engine.submit(Request(
            rid=seq.rid, prompt_ids=seq.ids, params=params,
            on_output=lambda o: loop.call_soon_threadsafe(q.put_nowait, o),
            stop_ids=frozenset(stop_ids), return_logprob=result.return_logprob,
            top_logprobs_num=item.top_logprobs_num, return_routed_experts=body.return_routed_experts,
            stream=stream, logprob_start_len=item.logprob_start_len,
            token_ids_logprob=item.token_ids_logprob if result.return_logprob else None,
            # An adapter's KV differs from the base's: its requests neither read nor write the cache.
            cacheable=body.extra_key is None and item.lora_path is None,
            lora_name=item.lora_path, grammar=seq.grammar,
        ))
        self.active.add(seq.rid)
        return result, q

    async def run_all(self, seqs: list[Seq], body: GenerateReqInput,
                      disconnected: Callable[[], Awaitable[bool]] | None = None) -> list[dict]:
        """Generate every sequence; SGLang's responses in order.

        One watcher per HTTP request polls `disconnected()`: when the client has gone (it gave up,
        its HTTP timeout passed) every unfinished sequence is aborted at once, so an abandoned
        batch frees the engine instead of running to the end.
        """
        started = [self.submit(s, body, stream=False) for s in seqs]
        watcher = None
        if disconnected is not None:
            watcher = asyncio.create_task(self._watch(disconnected, [r for r, _ in started]))
        try:
            for result, q in started:
                while not result.finished:
                    result.add(await q.get())
        finally:
            if watcher is not None:
                watcher.cancel()
            self._end([r for r, _ in started])
        return [r.response(self.tokenizer) for r, _ in started]

    async def _watch(self, disconnected: Callable[[], Awaitable[bool]], results: list[Result]) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await disconnected():  # the engine answers with abort events; run_all then ends
                self.engine.abort_many([r.rid for r in results if not r.finished],
                                       "client disconnected")
                return

    def _end(self, results: list[Result]) -> None:
        """Forget the rids; abort what is still running (the handler was cancelled)."""
        left = [r.rid for r in results if not r.finished]
        if left:
            self.engine.abort_many(left, "client disconnected")
        for r in results:
            self.active.discard(r.rid)

    async def stream(self, seqs: list[Seq], body: GenerateReqInput) -> AsyncIterator[bytes]:
        """SSE chunks; with several sequences (a batch, n > 1) each chunk carries its `index`.

        By default every chunk holds the whole output so far (SGLang's default); with
        --incremental-streaming-output only what is new since the sequence's previous chunk.
        """
        started = [self.submit(s, body, stream=True) for s in seqs]
        merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(i: int, q: asyncio.Queue[RequestOutput]) -> None:
            while True:
                out = await q.get()
                merged.put_nowait((i, out))
                if out.finished:
                    return

        pumps = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(started)]
        sent = [(0, 0)] * len(started)  # (output ids, text chars) already sent per sequence
        try:
            left = len(started)
            while left:
                i, out = await merged.get()
                result = started[i][0]
                result.add(out)
                left -= out.finished
                chunk = result.response(self.tokenizer)
                if self.incremental_stream:
                    chunk, sent[i] = _incremental(chunk, sent[i])
                if len(started) > 1:
                    chunk["index"] = seqs[i].index
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            for t in pumps:
                t.cancel()
            self._end([r for r, _ in started])


def _incremental(chunk: dict, sent: tuple[int, int]) -> tuple[dict, tuple[int, int]]:
    """The part of a cumulative chunk not sent yet (text, output ids, output log-probs)."""
    n_ids, n_chars = sent
    text, ids, meta = chunk["text"], chunk["output_ids"], chunk["meta_info"]
    out = {**chunk, "text": text[n_chars:], "output_ids": ids[n_ids:], "meta_info": dict(meta)}
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                "output_token_weight_versions"):
        if key in meta:
            out["meta_info"][key] = meta[key][n_ids:]
    return out, (len(ids), len(text))
