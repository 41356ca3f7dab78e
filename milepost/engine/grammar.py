"""Structured output: `json_schema`, `regex` and `ebnf` compiled by llguidance into token masks.

`GrammarCompiler` (one per server) wraps the engine's tokenizer for llguidance once, on the first
grammar request, and compiles each grammar in its own worker thread, off the event loop; a grammar
that does not compile is a `GrammarError` naming the field. Each sequence gets its own `Grammar`
(a matcher state): the engine thread asks it for the next token's bitmask before sampling
(`fill_masks`) and feeds it every accepted token (`Grammar.accept`). The bitmask is unpacked
and applied to the logits in the batched sampler (`apply_masks`); rows without a grammar are
never touched. llguidance was chosen over xgrammar (SGLang's default) for its install: one
3 MB abi3 wheel with no dependencies (xgrammar pulls triton and a TVM runtime).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for "any JSON value"
CACHE_SIZE = 64  # compiled grammars kept (a rollout repeats one schema for every request)


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message names the field and the reason."""


class Grammar:
    """One sequence's position in its grammar: the next token's mask, and the tokens so far.

    Used on the engine thread only. `accept` returns what the token did: None (go on),
    "end" (the grammar is complete and the token was an end-of-sequence token: finish), or an
    error message (the token is not allowed: it cannot happen when the mask was applied).
    """

    def __init__(self, matcher: object, eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_ids = eos_ids

    def accept(self, token: int) -> str | None:
        m = self.matcher
        if not m.consume_token(token):
            return f"the grammar refused token {token}: {m.get_error()}"
        if m.is_stopped() and token in self.eos_ids:
            return "end"
        return None


class GrammarCompiler:
    """Compiles the grammar of a request's sampling params into one `Grammar` per sequence."""

    def __init__(self, tokenizer: object | None, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self._ll_tokenizer: object | None = None  # built on the first grammar (3 s for 151k here)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        # One thread: compiles are serialized (a burst of one schema compiles it once) and the
        # event loop never waits on one.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="milepost-grammar")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def compile(self, field: str, text: str, copies: int, where: str = "sampling_params"
                      ) -> list[Grammar]:
        """`copies` fresh Grammars for `field` = `text`, compiled in the grammar thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: self.compile_now(field, text, copies, where))

    def compile_now(self, field: str, text: str, copies: int = 1, where: str = "sampling_params"
                    ) -> list[Grammar]:
        matcher = self._compiled(field, text, f"{where}.{field}" if where else field)
        return [Grammar(matcher.deep_copy(), self.eos_ids) for _ in range(copies)]

    def _compiled(self, field: str, text: str, name: str) -> object:
        key = (field, text)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        try:
            import llguidance
        except ImportError:
            raise GrammarError(f"{name}: structured output needs the llguidance package, which "
                               "is not installed (pip install llguidance)") from None
        tok = self._tokenizer(name)
        try:
            if field == "json_schema":
                schema = "{}" if text == ANY_JSON else text
                try:
                    json.loads(schema)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"{name}: not valid JSON ({e})") from None
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            else:
                grammar = llguidance.grammar_from("regex" if field == "regex" else "ebnf", text)
        except ValueError as e:  # the schema is no JSON object; a GBNF that does not convert
            raise GrammarError(f"{name}: {e}") from None
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{name}: {_first_line(matcher.get_error())}")
        self._cache[key] = matcher
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return matcher

    def _tokenizer(self, name: str) -> object:
        if self._ll_tokenizer is None:
            import llguidance.hf
            from transformers import PreTrainedTokenizerFast

            if not isinstance(self.tokenizer, PreTrainedTokenizerFast):
                raise GrammarError(f"{name}: structured output needs the model's fast (Hugging "
                                   "Face tokenizers) tokenizer, and this server has none")
            # n_vocab: the logits' width (often padded past the tokenizer's last id); the extra
            # ids are never allowed. Every id the engine stops on ends an accepted grammar.
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids) or None)
            self.eos_ids = frozenset(self._ll_tokenizer.eos_tokens)  # the tokenizer's, if none given
        return self._ll_tokenizer


def _first_line(message: str) -> str:
    """llguidance's errors can carry a multi-line caret diagram: keep it, but on one line."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())


@functools.lru_cache(maxsize=1)
def _executor() -> object:
    """llguidance's pool for computing many masks at once (threads: most of the host's cores),
    made on the first batch with two grammar rows."""
    import llguidance

    return llguidance.LLExecutor()


def fill_masks(grammars: Sequence[Grammar], banned: Sequence[Sequence[int]], vocab_size: int
               ) -> torch.Tensor:
    """[len(grammars), ceil(V / 32)] int32 bitmask on the host: bit t of row i allows token t.

    banned[i]: ids row i may not produce now (stop ids before min_new_tokens); they are cleared
    in the mask unless that would leave the row empty (the grammar must end there).
    """
    width = (vocab_size + 31) // 32
    masks = torch.zeros(len(grammars), width, dtype=torch.int32)
    stride = width * 4
    if len(grammars) > 1:  # llguidance's thread pool, one row per matcher
        _executor().unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                            masks.data_ptr(), stride, len(grammars))
    elif grammars:
        grammars[0].matcher.unsafe_compute_mask_ptr(masks.data_ptr(), stride)
    words = masks.numpy().view(np.uint32)  # the same memory, bit operations unsigned
    for i, ids in enumerate(banned):
        if ids:
            row = words[i].copy()
            for t in ids:
                row[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
            if row.any():
                words[i] = row
    return masks


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set to -inf, in place, every token row rows[j]'s bitmask masks[j] does not allow.

    logits: [B, V] fp32; masks: [len(rows), ceil(V / 32)] int32 on the host. The masks travel
    through pinned memory (no wait for queued GPU work) and are unpacked on the device.
    """
    dev, vocab = logits.device, logits.shape[1]
    if dev.type == "cuda":
        masks = masks.pin_memory().to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((masks[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [r, V]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows)
    if dev.type == "cuda":
        index = index.pin_memory().to(dev, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def response_format_params(fmt: dict | None) -> dict[str, str]:
    """OpenAI's `response_format` as sampling params, mapped as SGLang maps it: `text` -> none,
    `json_object` -> json_schema {"type": "object"}, `json_schema` -> its `schema`.
    A malformed value raises ValueError naming the part at fault."""
    if fmt is None:
        return {}
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"response_format.type: {kind!r} is not supported; use text, json_object "
                         "or json_schema")
    unknown = sorted(set(fmt) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if unknown:
        raise ValueError(f"response_format: unexpected field(s) {unknown} for type {kind!r}")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError(  # noqa: TRY004 - a validator's ValueError is what pydantic reports
            "response_format.json_schema.schema: give the JSON schema, an object "
            '({"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}})')
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise ValueError(f"response_format.json_schema: unknown field(s) {unknown}; expected "
                         f"{sorted(_JSON_SCHEMA_KEYS)}")
    return {"json_schema": json.dumps(spec["schema"])}
