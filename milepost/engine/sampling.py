"""Sampling parameters (SGLang's names) and the batched sampler.

Rollout log-probs are `log_softmax(logits / temperature)` at the sampled token, in fp32, taken
BEFORE top-p / top-k / min-p truncation: that is the distribution the trainer recomputes, so the
train-rollout mismatch stays measurable. Greedy requests (temperature < 1e-5) report
`log_softmax(logits)` (temperature 1) since dividing by ~0 would make every log-prob 0 or -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GREEDY_EPS = 1e-5


class SamplingParams(BaseModel):
    """SGLang's `sampling_params`; unknown keys are refused so a typo never silently does nothing."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=0, description="Most tokens to generate.")
    min_new_tokens: int = Field(0, ge=0, description="Stop tokens are banned until this many.")
    temperature: float = Field(1.0, ge=0.0, description="0 (or < 1e-5) means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept.")
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 or 0 keeps all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    stop: str | list[str] | None = Field(None, description="Stop strings (not in the output text).")
    stop_token_ids: list[int] | None = Field(None, description="Extra token ids that stop.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    n: int = Field(1, ge=1, le=1024, description="Independent samples of this prompt.")
    sampling_seed: int | None = Field(None, description="Seed for reproducible sampling.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from output text.")
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = Field(False, description="Keep the matched stop string in the text.")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("top_k must be -1 (off) or a positive number of tokens")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32, log_softmax(logits / T) at the token
    top_ids: torch.Tensor | None  # [B, k] int64
    top_logprobs: torch.Tensor | None  # [B, k] fp32


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
    top_logprobs_num: int = 0,
) -> SampleResult:
    """logits: [B, V] fp32 -> one token per row.

    banned[i]: token ids row i may not produce this step (stop tokens before min_new_tokens).
    Rows without truncation share one softmax; truncation (top-k/top-p/min-p) runs only on the
    rows that ask for it, so the common RL case (T=1, no truncation) does no sort.
    """
    logits = logits.float()
    if any(banned):
        # .float() is a no-op on fp32 input: copy before banning so the caller's logits stay intact.
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, ids] = float("-inf")
    temps = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params], device=logits.device
    )
    logprobs_all = torch.log_softmax(logits / temps[:, None], dim=-1)  # [B, V]

    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    for i in (i for i, p in enumerate(params) if not p.greedy):
        tokens[i] = _sample_row(logprobs_all[i], params[i], generators[i])

    chosen = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    top_ids = top_lp = None
    if top_logprobs_num > 0:
        top_lp, top_ids = logprobs_all.topk(min(top_logprobs_num, logits.shape[-1]), dim=-1)
    return SampleResult(tokens, chosen, top_ids, top_lp)


def _sample_row(
    logprobs: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw one token from exp(logprobs) after the row's truncations; logprobs: [V]."""
    probs = logprobs.exp()
    if 0 < p.top_k < probs.shape[0]:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[mass_before >= p.top_p * sorted_probs.sum()] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
