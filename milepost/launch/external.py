"""The conformance check of `--engine-backend external` servers, before a run relies on them.

Servers the user started (SGLang, or `milepost serve`) are probed with what the run will send:
`/health`, `/get_weight_version`, and a greedy `/generate` on `input_ids` with log-probs, read by
the rollout's own parser (rollout/engine_output.py). A text probe with prompt log-probs returns
the server's token ids, which must equal this checkpoint's tokenizer's (a server with another
model's tokenizer would silently train on misread tokens). Behind sglang-router the probe is sent
once more through the router, with a routing key. Any failure names the URL, the check and a fix.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx

from milepost.http_tls import tls_context
from milepost.launch.process import ComponentStartError

# Letters, digits, spaces, punctuation and non-ASCII: two tokenizers rarely agree on all of it.
PROBE_TEXT = "Probe 12+30=42, naïve café; ok?\n  Done."
PROBE_NEW_TOKENS = 4
ROUTING_KEY = "milepost-conformance-probe"


def check_external_engines(urls: list[str], hf_checkpoint: Path, api_key: str | None = None,
                           timeout_s: float = 120.0) -> None:
    """Refuse (ComponentStartError) any server at `urls` the run could not use as an engine."""
    want = _local_ids(hf_checkpoint)
    for url in urls:
        client = _Client(url, api_key, timeout_s)
        client.health()
        client.weight_version()
        client.generate_ids()
        client.token_ids(want)


def check_router(router_url: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
    """The /generate probe through sglang-router, as a session's requests go (with a key)."""
    _Client(router_url, api_key, timeout_s, "router", {"X-SMG-Routing-Key": ROUTING_KEY}
            ).generate_ids()


def _local_ids(hf_checkpoint: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(hf_checkpoint)(PROBE_TEXT)["input_ids"])


class _Client:
    def __init__(self, url: str, api_key: str | None, timeout_s: float, what: str = "engine_urls",
                 headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.where = f"{what}: {self.url}"
        self.headers = dict(headers or {})
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    def fail(self, check: str, fix: str) -> ComponentStartError:
        return ComponentStartError(f"{self.where} failed the conformance check ({check}); {fix}")

    def call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            return httpx.request(method, self.url + path, json=body, headers=self.headers,
                                 timeout=self.timeout_s, verify=tls_context())
        except httpx.HTTPError as e:
            raise self.fail(f"{method} {path}: {type(e).__name__}: {e}",
                            "is the server running, and is the URL right?") from None

    def json(self, method: str, path: str, body: dict | None = None) -> object:
        r = self.call(method, path, body)
        if r.status_code != 200:
            hint = ("pass its key with --api-key" if r.status_code == 401 else
                    "it must speak SGLang's HTTP protocol (docs/engine.md)")
            raise self.fail(f"{method} {path} answered {r.status_code}: {r.text[:200]!r}", hint)
        try:
            return r.json()
        except ValueError:
            raise self.fail(f"{method} {path} answered no JSON: {r.text[:200]!r}",
                            "it must speak SGLang's HTTP protocol (docs/engine.md)") from None

    def health(self) -> None:
        r = self.call("GET", "/health")
        if r.status_code != 200:
            raise self.fail(f"GET /health answered {r.status_code}",
                            "wait until the server is up, or check its log")

    def weight_version(self) -> None:
        body = self.json("GET", "/get_weight_version")
        if not isinstance(body, dict) or "weight_version" not in body:
            raise self.fail(f"GET /get_weight_version gave {str(body)[:200]!r}, no weight_version",
                            "use an SGLang with weight versions (--weight-version)")

    def generate_ids(self) -> None:
        from milepost.rollout.engine_output import EngineProtocolError, parse_generate

        body = self.json("POST", "/generate", {
            "input_ids": [1, 2, 3, 4], "return_logprob": True,
            "sampling_params": {"max_new_tokens": PROBE_NEW_TOKENS, "temperature": 0.0,
                                "ignore_eos": True}})
        try:
            out = parse_generate(body, self.url + "/generate", return_logprob=True)
        except EngineProtocolError as e:
            raise self.fail(str(e), "it must answer in SGLang's /generate shape") from None
        if not 1 <= len(out.output_ids) <= PROBE_NEW_TOKENS:
            raise self.fail(f"/generate returned {len(out.output_ids)} tokens for max_new_tokens "
                            f"{PROBE_NEW_TOKENS} with ignore_eos", "check the server's version")
        if not all(math.isfinite(lp) and lp <= 1e-4 for lp in out.logprobs):
            raise self.fail(f"/generate log-probs {out.logprobs} are not finite values <= 0",
                            "check the server's version")
        if out.finish_type not in ("stop", "length"):
            raise self.fail(f"/generate finished with {out.finish_reason}", "check its log")
        if "weight_version" not in out.meta_info:
            raise self.fail("/generate meta_info has no weight_version",
                            "use an SGLang that reports weight versions (--weight-version)")

    def token_ids(self, want: list[int]) -> None:
        body = self.json("POST", "/generate", {
            "text": PROBE_TEXT, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        try:
            got = [int(e[1]) for e in body["meta_info"]["input_token_logprobs"]]
        except (KeyError, TypeError, ValueError, IndexError):
            raise self.fail("/generate with logprob_start_len 0 gave no input_token_logprobs",
                            "it must return prompt log-probs as SGLang does") from None
        if got != want:
            raise self.fail(
                f"its tokenizer reads {PROBE_TEXT!r} as {got}, this run's --hf-checkpoint "
                f"tokenizer as {want}", "serve the same model (tokenizer) as --hf-checkpoint")
