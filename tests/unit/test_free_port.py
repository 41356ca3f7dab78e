"""free_port: a bindable loopback port below the kernel's ephemeral range, so an outgoing
connection cannot take it before the server binds it."""

from __future__ import annotations

import socket

from milepost.launch.process import _ephemeral_low, free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # random, not the same port every time
    for port in ports:
        assert 1024 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))



def test_free_port_never_hands_out_a_port_twice() -> None:
    """A server started without waiting has not bound its port yet when the next port is picked
    (an engine's, then the trainer's MASTER_PORT): 1,000 draws from the ~12,000-port range would
    repeat one almost surely if the ports handed out were not remembered."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
