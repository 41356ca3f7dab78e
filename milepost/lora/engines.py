"""The trainer's side of serving its adapter: put it in every engine before the first rollout.

The engines start with `--enable-lora` and no adapter; rank 0 loads the trainer's current adapter
(exported as a PEFT directory, a collective every rank joins) under the name `policy`, replacing
an adapter of that name left by an earlier run on external engines. Weight updates then write its
tensors (`policy/<name>`), and every rollout request names it (`lora_path`).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from milepost.auth import client_headers
from milepost.lora.settings import POLICY_ADAPTER


class AdapterLoadError(RuntimeError):
    """An engine refused the trainer's adapter; the message names the engine and its reason."""


def load_policy_adapter(backend: object, engine_urls: list[str], directory: Path, lead: bool,
                        timeout_s: float = 120.0) -> None:
    """Collective: every trainer rank calls it; rank 0 (`lead`) loads the adapter into each engine."""
    backend.export_hf(directory)  # with LoRA: a PEFT adapter directory
    if not lead:
        return
    for url in engine_urls:
        with httpx.Client(base_url=url, timeout=timeout_s, headers=client_headers()) as http:
            http.post("/unload_lora_adapter", json={"lora_name": POLICY_ADAPTER})  # absent is fine
            r = http.post("/load_lora_adapter", json={"lora_name": POLICY_ADAPTER,
                                                       "lora_path": str(directory)})
            if r.status_code != 200:
                raise AdapterLoadError(
                    f"engine {url} did not load the LoRA adapter from {directory} "
                    f"({r.status_code}): {r.text}; engines of a --lora-rank run need --enable-lora, "
                    "--max-lora-rank >= the rank and the same --lora-target-modules")
