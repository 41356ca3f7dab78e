"""New weights to the diffusion engine through the text engine's transports and checks.

tensor: SGLang's /update_weights_from_tensor body with the project's codec; disk: safetensors
in run_dir/weights + /update_weights_from_disk; broadcast: the text engine's BroadcastTransport
(a torch.distributed gloo group of trainer and engine, /update_weights_from_distributed, buckets
of BUCKET_BYTES; gloo because trainer and engine may share one GPU, which NCCL cannot). With
check_weight_update, the engine's checksums must equal the trainer's expected state
(milepost.weights.verify), and its version the one sent.
"""

from __future__ import annotations

import httpx
import torch

from milepost.weights.codec import serialize_named_tensors
from milepost.weights.transport import BroadcastTransport
from milepost.weights.verify import verify

BUCKET_BYTES = 256 << 20


def buckets(named: list[tuple[str, torch.Tensor]], size: int = BUCKET_BYTES) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `size` bytes (a larger tensor goes alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and used + n > size:
            out.append([])
            used = 0
        out[-1].append((name, t))
        used += n
    return out


def push_weights(trainer, url: str, cfg, version: str, timeout_s: float = 300.0,
                 transport: BroadcastTransport | None = None) -> None:
    """Send the trainer's engine weights as `version` by cfg.weight_transport (broadcast: over
    `transport`, which the caller keeps for the run: its group is made on the first update)."""
    named = trainer.engine_weights()
    if cfg.weight_transport == "broadcast":
        assert transport is not None, "--weight-transport broadcast needs the run's BroadcastTransport"
        transport.begin(version)
        parts = buckets(named)
        for i, part in enumerate(parts):
            transport.send(part, last=i == len(parts) - 1)
        transport.finish(version)
        if cfg.check_weight_update:
            verify(trainer.expected_engine_state().items(), [url], timeout_s)
        return
    if cfg.weight_transport == "tensor":
        body = {"serialized_named_tensors": [serialize_named_tensors(named)], "weight_version": version}
        r = httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=timeout_s)
    else:
        from safetensors.torch import save_file

        path = cfg.run_dir / "weights"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in named}, str(path / "model.safetensors"))
        r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(path), "weight_version": version},
                       timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"weight update to {url} failed ({r.status_code}): {r.text[:500]}")
    if r.json().get("weight_version") != version:
        raise RuntimeError(f"engine {url} reports weight_version {r.json().get('weight_version')!r}, sent {version!r}")
    if cfg.check_weight_update:
        verify(trainer.expected_engine_state().items(), [url], timeout_s)
