"""What an engine answers, as milepost reads it: `/generate` output and the engine's errors.

Errors split by what a caller can do about them: `EngineRequestError` (4xx, the request is at
fault: retrying cannot help; carries the engine's message) and `EngineUnavailableError`
(connection refused or lost, timeout, 5xx: the engine may come back; callers retry or give up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx


class EngineError(RuntimeError):
    """Base of the errors of an engine call; `url` names the endpoint."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        self.url = url
        self.status = status
        self.message = message
        where = f"{url} answered {status}" if status is not None else url
        super().__init__(f"{where}: {message}")


class EngineRequestError(EngineError):
    """The engine refused the request (4xx, or `success: false`); `message` is the engine's own."""


class EngineUnavailableError(EngineError):
    """The engine could not be reached, dropped the connection, timed out or answered 5xx."""


class EngineProtocolError(EngineError):
    """The engine answered 2xx with a body that breaks SGLang's protocol (a bug or version skew)."""


@dataclass
class GenerateOutput:
    """One `/generate` answer.

    output_ids / logprobs / weight_versions: [completion tokens], aligned.
    finish_reason: SGLang's dict, e.g. {"type": "stop", "matched": 2} | {"type": "length", ...}
        | {"type": "abort", "message": ...}.
    routed_experts: base64 int32 (prompt + completion - 1, layers, top_k), when asked for (MoE).
    """

    output_ids: list[int]
    text: str
    logprobs: list[float]
    weight_versions: list[str]
    finish_reason: dict[str, Any]
    weight_version: str
    prompt_tokens: int
    cached_tokens: int
    routed_experts: str | None = None
    rid: str | None = None
    e2e_latency: float | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def finish_type(self) -> str:
        return str(self.finish_reason.get("type", ""))


def parse_generate(body: Any, url: str, return_logprob: bool) -> GenerateOutput:
    """SGLang's `/generate` response -> GenerateOutput, checking that the token fields agree."""
    try:
        meta = body["meta_info"]
        out_ids = [int(t) for t in body["output_ids"]]
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, str):  # some SGLang versions send a bare type
            finish = {"type": finish}
        version = str(meta.get("weight_version", ""))
        logprobs: list[float] = []
        if return_logprob:
            entries = meta["output_token_logprobs"]
            logprobs = [float(e[0]) for e in entries]
            ids = [int(e[1]) for e in entries]
            if ids != out_ids:
                raise ValueError("output_token_logprobs token ids differ from output_ids")
        # `output_token_weight_versions` is milepost's extension; a real SGLang server reports one
        # version per request, which then holds for every token.
        versions = meta.get("output_token_weight_versions")
        versions = [str(v) for v in versions] if versions is not None else [version] * len(out_ids)
        if len(versions) != len(out_ids):
            raise ValueError(f"{len(versions)} output_token_weight_versions for "
                             f"{len(out_ids)} output_ids")
        return GenerateOutput(
            output_ids=out_ids, text=body.get("text", ""), logprobs=logprobs,
            weight_versions=versions, finish_reason=finish, weight_version=version,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            routed_experts=meta.get("routed_experts"), rid=meta.get("id"),
            e2e_latency=meta.get("e2e_latency"), meta_info=meta,
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise EngineProtocolError(url, f"malformed /generate response ({type(e).__name__}: {e})"
                                  ) from e


def _error_message(resp: httpx.Response) -> str:
    """The engine's message: `{"error": {"message"}}` (SGLang, FastAPI), `{"message"}` (weight
    updates), `{"detail"}` (FastAPI), or the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)
