"""Ports for a rendezvous that another process will bind: picked below the kernel's ephemeral range.

A port found free by binding port 0 comes from the ephemeral range, where every outgoing connection (gloo's
pairs, gRPC, Ray) also takes its local port: between the pick and the rendezvous host's bind, one of them
can take it (EADDRINUSE). Below that range only listeners bind, so a pick stays free unless another
process picks the same port, which the random choice makes unlikely and the bind check catches when it
happened earlier.
"""

from __future__ import annotations

import contextlib
import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768
_LOWEST = 20000  # above Ray's worker ports (10002-19999 by default) and well-known services


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free on `host` now (all bound at once, then released), chosen at random
    below the ephemeral range when it leaves room (else any free port).

    Raises OSError: no free port found."""
    high = _ephemeral_low() - 1
    candidates = random.sample(range(_LOWEST, high), min(256, high - _LOWEST)) if high - _LOWEST > 256 else []
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in [*candidates, *[0] * count]:
            if len(ports) == count:
                break
            s = stack.enter_context(socket.socket())
            try:
                s.bind((host, port))
            except OSError:
                continue
            ports.append(s.getsockname()[1])
        if len(ports) < count:
            raise OSError(f"no {count} free ports on {host or 'any interface'}")
        return ports
