"""One generation request as the engine tracks it, and the output events it emits."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from milepost.engine.grammar import Grammar
from milepost.engine.sampling import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What the engine tells a request's owner: the tokens since the last event, and finish state.

    Lists are slices produced since the previous event of this request, so a stream costs O(new
    tokens) per step; the owner concatenates them.
    """

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[list[tuple[float, int]]]
    new_weight_versions: list[str]
    prompt_tokens: int
    cached_tokens: int
    finished: bool
    finish_reason: dict | None = None
    routed_experts: str | None = None  # base64 of int32 [prompt+completion-1, layers, top_k], C order
    weight_version: str = ""
    # Prompt log-probs (complete once the prompt is prefilled; the lists are the request's own).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_ids_logprobs: list[list[float] | None] | None = None
    new_ids_logprobs: list[list[float]] | None = None  # token_ids_logprob at each new token
    prompt_ids: list[int] | None = None  # set with input_logprobs (the tokens they score)
    # Speculative decoding: (verify steps, proposed, accepted) so far (SGLang's spec_verify_ct,
    # spec_num_proposed_drafts, spec_num_correct_drafts); None when the engine does not speculate.
    spec_counts: tuple[int, int, int] | None = None


@dataclass(eq=False)  # identity: queues find and remove a request without comparing fields
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    stop_ids: frozenset[int]  # stop_token_ids, plus EOS unless ignore_eos
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    stream: bool = False
    # Prompt log-probs from this prompt position on (SGLang's logprob_start_len); -1: none.
    logprob_start_len: int = -1
    token_ids_logprob: list[int] | None = None  # log-probs of these ids at every position
    cacheable: bool = True  # False (a cache salt was given): no shared prefix read or written
    grammar: Grammar | None = None  # structured output: this sequence's matcher (grammar.py)
    lora_name: str | None = None  # the LoRA adapter it runs with (milepost/lora/); None: the base
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.monotonic)

    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of all_ids whose KV is in `blocks`
    draft_computed: int = 0  # speculative draft model: positions whose draft KV is in `blocks`
    spec_verify_ct: int = 0  # speculative steps that verified proposals of this request
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0
    cached_tokens: int = 0  # prefix-cache hits at first admission (SGLang's meta_info field)
    admitted_once: bool = False
    emitted: int = 0  # output tokens already sent to the owner
    finish_reason: dict | None = None
    first_token_time: float | None = None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_ids_logprobs: list[list[float] | None] = field(default_factory=list)
    output_ids_logprobs: list[list[float]] = field(default_factory=list)
    penalized: bool = field(init=False, default=False)  # params.penalized, cached
    adjusts_logits: bool = field(init=False, default=False)  # params.adjusts_logits, cached

    def __post_init__(self) -> None:
        # Read every step for every row: computed once here, not from the params each time.
        self.penalized = self.params.penalized
        self.adjusts_logits = self.params.adjusts_logits
        if self.logprob_start_len == 0:  # the first prompt token has no log-prob (SGLang: None)
            self.input_logprobs.append(None)
            self.input_top_logprobs.append(None)
            self.input_ids_logprobs.append(None)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens_to_compute(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return self.total_len - self.num_computed

    @property
    def prompt_lp_next(self) -> int:
        """The next prompt position whose log-prob is still to compute (len(prompt): none)."""
        if self.logprob_start_len < 0:
            return len(self.prompt_ids)
        return self.logprob_start_len + len(self.input_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.state is ReqState.FINISHED
