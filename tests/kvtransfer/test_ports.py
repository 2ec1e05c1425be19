"""Rendezvous ports are picked below the ephemeral range, where outgoing connections cannot take them."""

from __future__ import annotations

import socket

from pdcluster.kvtransfer.ports import _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports("127.0.0.1", 3)
    assert len(set(ports)) == 3
    low = _ephemeral_low()
    assert all(p < low for p in ports), (ports, low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
