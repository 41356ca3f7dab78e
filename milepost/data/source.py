"""Prompt datasets: JSONL or Parquet rows, tokenized once at load, served in seeded epochs.

Every row is checked and tokenized when the file is loaded, so a malformed row stops the run at
start (naming file, line and key) rather than mid-run. Prompts whose generation was given up on
go back through `requeue` and are served before new ones, so no prompt is silently lost; the retry
queue is part of `state_dict`, so a resumed run sees the same data in the same order.
"""

from __future__ import annotations

import json
import logging
import random
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


@dataclass
class PromptItem:
    """One prompt of a dataset.

    index: the row's position in the file (stable across runs, epochs and resumes).
    prompt: the row's prompt as given: text, or a list of chat messages.
    prompt_ids: [prompt tokens] what the engine receives (chat template already applied).
    """

    index: int
    prompt: str | Messages
    prompt_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class DataSource(Protocol):
    """What the driver needs from a data source (a plug-in may replace `PromptDataset`)."""

    def next_batch(self, n: int) -> list[PromptItem]: ...

    def requeue(self, items: Iterable[PromptItem]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file, line and key."""


class PromptDataset:
    """Prompts served in epochs; each epoch's order is a shuffle seeded by (seed, epoch).

    `next_batch(n)` serves requeued prompts first, then continues the current epoch, starting the
    next epoch (a fresh seeded order) when one runs out, so a batch may straddle two epochs.
    """

    def __init__(self, items: list[PromptItem], *, shuffle: bool = True, seed: int = 0,
                 name: str = "dataset") -> None:
        if not items:
            raise DatasetError(f"{name}: no prompts to serve (the dataset is empty)")
        self.items = items
        self.shuffle = shuffle
        self.seed = seed
        self.name = name
        self.epoch = 0
        self.offset = 0  # position within the current epoch's order
        self.num_requeued = 0  # prompts handed back through `requeue`, over the whole run
        self._retry: deque[PromptItem] = deque()
        self._order = self._epoch_order(0)

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        tokenizer: Any,
        *,
        input_key: str = "prompt",
        label_key: str | None = "label",
        metadata_key: str | None = "metadata",
        apply_chat_template: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_prompt_len: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> PromptDataset:
        """Load and tokenize every row of a `.jsonl` (one object a line) or `.parquet` file.

        input_key: the prompt field, plain text or a list of chat messages `{role, content, ...}`.
        label_key: the field rewards compare with; None when rows have no label (else required).
        metadata_key: an optional object (or JSON text of one) per row, handed to reward functions.
        apply_chat_template: render the prompt with the tokenizer's chat template
            (add_generation_prompt=True; text becomes one user message); if False, the prompt
            must be text and is tokenized as is (the tokenizer's own special tokens included).
        chat_template_kwargs: extra template variables, e.g. {"enable_thinking": False}.
        max_prompt_len: drop (and count in the log) prompts longer than this many tokens.
        """
        path = Path(path)
        if not path.is_file():
            raise DatasetError(f"{path}: no such dataset file")
        rows = list(_read_rows(path))
        if not rows:
            raise DatasetError(f"{path}: the file holds no rows")
        prompts: list[str | Messages] = []
        labels: list[Any] = []
        metas: list[dict[str, Any]] = []
        for where, row in rows:
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
            if input_key not in row or row[input_key] is None:
                raise DatasetError(
                    f"{where}: no {input_key!r} field (the row has {sorted(row)}); "
                    "set input_key to the field that holds the prompt")
            prompts.append(_check_prompt(row[input_key], where, input_key, apply_chat_template))
            if label_key is not None and label_key not in row:
                raise DatasetError(
                    f"{where}: no {label_key!r} field (the row has {sorted(row)}); set label_key "
                    "to the field that holds the label, or to None if rows have no label")
            labels.append(row.get(label_key) if label_key is not None else None)
            metas.append(_check_metadata(row.get(metadata_key) if metadata_key else None,
                                         where, metadata_key))
        ids = _tokenize(tokenizer, prompts, [w for w, _ in rows], apply_chat_template,
                        chat_template_kwargs or {}, path)
        items = [PromptItem(i, p, t, lab, m)
                 for i, (p, t, lab, m) in enumerate(zip(prompts, ids, labels, metas))]
        if max_prompt_len is not None:
            kept = [it for it in items if len(it.prompt_ids) <= max_prompt_len]
            if len(kept) < len(items):
                log.warning("%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens",
                            path, len(items) - len(kept), len(items), max_prompt_len)
            if not kept:
                raise DatasetError(f"{path}: every prompt is longer than max_prompt_len="
                                   f"{max_prompt_len} tokens; raise it")
            items = kept
        return cls(items, shuffle=shuffle, seed=seed, name=str(path))

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_pending_retries(self) -> int:
        return len(self._retry)

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next `n` prompts: requeued ones first (oldest first), then the epoch's order."""
        if n < 1:
            raise ValueError(f"next_batch: n must be >= 1, got {n}")
        out: list[PromptItem] = []
        while self._retry and len(out) < n:
            out.append(self._retry.popleft())
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            take = self._order[self.offset:self.offset + n - len(out)]
            out += [self.items[i] for i in take]
            self.offset += len(take)
        return out

    def requeue(self, items: Iterable[PromptItem]) -> None:
        """Put prompts whose generation was given up on first in line (in the given order)."""
        items = list(items)
        self._retry.extend(items)
        self.num_requeued += len(items)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "shuffle": self.shuffle, "num_items": len(self.items),
                "retry": [it.index for it in self._retry], "num_requeued": self.num_requeued}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_items"] != len(self.items):
            raise DatasetError(
                f"{self.name}: the saved data state is of a dataset of {state['num_items']} "
                f"prompts, this one has {len(self.items)}; resume with the same prompt data")
        by_index = {it.index: it for it in self.items}
        self.seed = state["seed"]
        self.shuffle = state["shuffle"]
        self.epoch = state["epoch"]
        self.offset = state["offset"]
        self.num_requeued = state.get("num_requeued", 0)
        self._retry = deque(by_index[i] for i in state.get("retry", []))
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:  # a fresh generator per epoch: the order depends on (seed, epoch) only
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order


def _read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row; `where` is "file:line N" (JSONL) or "file:row N" (Parquet)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
    elif suffix in (".jsonl", ".json", ".ndjson"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:line {n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:line {n}: not valid JSON ({e}); "
                                       "the file must hold one JSON object per line") from e
    else:
        raise DatasetError(f"{path}: unknown dataset format {suffix!r}; use .jsonl or .parquet")


def _check_prompt(value: Any, where: str, key: str, chat: bool) -> str | Messages:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
                raise DatasetError(f"{where}: {key}[{i}] is not a chat message "
                                   "(an object with 'role' and 'content')")
        if not chat:
            raise DatasetError(f"{where}: {key} is a list of chat messages but "
                               "apply_chat_template is off; turn it on to render them")
        return value
    raise DatasetError(f"{where}: {key} must be text or a list of chat messages, "
                       f"got {type(value).__name__}")


def _check_metadata(value: Any, where: str, key: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):  # Parquet files often keep nested data as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: {key} is text but not JSON ({e})") from e
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: {key} must be an object, got {type(value).__name__}")
    return value


def _tokenize(tokenizer: Any, prompts: list[str | Messages], wheres: list[str], chat: bool,
              template_kwargs: dict[str, Any], path: Path) -> list[list[int]]:
    if not chat:
        return [list(ids) for ids in tokenizer(prompts)["input_ids"]]
    if getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError(f"{path}: apply_chat_template is on but the tokenizer has no chat "
                           "template; turn it off to tokenize prompts as plain text")
    texts = []
    for p, where in zip(prompts, wheres):
        try:
            texts.append(tokenizer.apply_chat_template(
                [{"role": "user", "content": p}] if isinstance(p, str) else p,
                tokenize=False, add_generation_prompt=True, **template_kwargs))
        except Exception as e:  # jinja's raise_exception, a bad role, content of a wrong type
            raise DatasetError(f"{where}: the chat template refused this prompt: {e}") from e
    # The template already wrote every special token: adding them again would double a BOS.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
