"""The one record that flows end to end: a `Sample` (one trajectory), grouped by prompt.

A sample holds exactly the tokens the engine produced (token-in-token-out: never re-tokenized),
the rollout log-probs and the weight version of every response token, the reward and why the
trajectory ended. Rollout fills it, the buffer holds it, the trainer consumes it.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(str, enum.Enum):
    COMPLETED = "completed"  # the model stopped (EOS / stop string)
    TRUNCATED = "truncated"  # hit the response length limit
    ABORTED = "aborted"  # generation gave up (abort, timeout, engine gone): not trainable


@dataclass
class Sample:
    """One trajectory.

    tokens: prompt + response ids, exactly as generated.
    response_length: the last `response_length` tokens are the response.
    loss_mask: [response_length] 1 where the trainer learns from the token (0 for e.g. tool output).
    rollout_logprobs: [response_length] the engine's log-probs of the sampled tokens.
    weight_versions: [response_length] the weight version that sampled each response token.
    routed_experts: base64 int32 (len(tokens) - 1, layers, top_k) from the engine, MoE only.
    """

    group_index: int
    index: int  # position within the group
    tokens: list[int]
    response_length: int
    prompt: str | list[dict] = ""
    response: str = ""
    label: Any = None
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    routed_experts: str | None = None
    teacher_logprobs: list[float] | None = None
    reward: float | None = None
    status: Status = Status.COMPLETED
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        return cls(**{**d, "status": Status(d["status"])})


Group = list[Sample]
