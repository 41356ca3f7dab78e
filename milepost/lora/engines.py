"""The trainer's side of serving its adapter: put it in every engine before the first rollout.

The engines start with `--enable-lora` and no adapter; rank 0 loads the trainer's current adapter
(exported as a PEFT directory, a collective every rank joins) under the name `policy` (multi-LoRA:
each adapter under its own name), replacing an adapter of that name left by an earlier run. Weight updates then write its
tensors (`policy/<name>`), and every rollout request names it (`lora_path`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import httpx

from milepost.auth import client_headers
from milepost.lora.settings import POLICY_ADAPTER


class AdapterLoadError(RuntimeError):
    """An engine refused the trainer's adapter; the message names the engine and its reason."""


def load_policy_adapter(backend: object, engine_urls: list[str], directory: Path, lead: bool,
                        timeout_s: float = 120.0, adapters: Sequence[str] = ()) -> None:
    """Collective: every trainer rank calls it; rank 0 (`lead`) loads the adapter into each engine.

    `adapters` (multi-LoRA): the backend exports DIRECTORY/<name> for each, loaded under its name.
    """
    backend.export_hf(directory)  # with LoRA: a PEFT adapter directory (one per adapter)
    if not lead:
        return
    loads = [(name, directory / name) for name in adapters] or [(POLICY_ADAPTER, directory)]
    for url in engine_urls:
        with httpx.Client(base_url=url, timeout=timeout_s, headers=client_headers()) as http:
            for name, path in loads:
                http.post("/unload_lora_adapter", json={"lora_name": name})  # absent is fine
                r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                if r.status_code != 200:
                    raise AdapterLoadError(
                        f"engine {url} did not load the LoRA adapter {name!r} from {path} "
                        f"({r.status_code}): {r.text}; engines of a --lora-rank run need --enable-lora, "
                        "--max-lora-rank >= the rank, --max-loras-per-batch >= the number of adapters "
                        "and the same --lora-target-modules")
