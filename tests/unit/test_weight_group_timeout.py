"""A weight-group rendezvous with a master nobody runs gives up after its setup timeout and frees
the group name (the next init of that name is tried, not refused as "already open")."""

from __future__ import annotations

import time

import pytest

from milepost.launch.process import free_port
from milepost.weights.process_group import WeightGroupRegistry


def test_setup_timeout_frees_the_name() -> None:
    groups = WeightGroupRegistry()
    port = free_port()  # nothing listens: the store can never be reached
    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="could not reach the store .* within 2s"):
            groups.init("127.0.0.1", port, 1, 2, "g", "gloo", setup_timeout_s=2)
        assert time.monotonic() - t0 < 20  # bounded by the setup timeout, not the 600 s default
    assert groups.names() == []
