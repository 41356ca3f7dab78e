"""One sender per weight transport for tests that push an update to a real engine over each of them
(the engine re-quantizes or re-packs on arrival; the equality check must pass on every one)."""

from __future__ import annotations

from pathlib import Path

from milepost.weights.disk_transport import DiskDeltaTransport
from milepost.weights.p2p import P2PTransport
from milepost.weights.transport import BroadcastTransport, TensorTransport, WeightTransport

TRANSPORT_KINDS = ("tensor", "broadcast", "p2p", "disk-delta")


def make_transport(kind: str, url: str, store: Path) -> WeightTransport:
    """A transport of `kind` to the engine at `url` (gloo groups; `store`: disk-delta's directory)."""
    return {"tensor": lambda: TensorTransport([url], timeout_s=30),
            "broadcast": lambda: BroadcastTransport([url], "gloo", timeout_s=30),
            "p2p": lambda: P2PTransport([url], "gloo", timeout_s=30),
            "disk-delta": lambda: DiskDeltaTransport([url], store, timeout_s=30)}[kind]()
