"""Rendezvous ports a CPU run can keep until its store listens on them.

verl picks its process group's ``MASTER_PORT`` by binding port 0 and closing the socket; the
workers' TCPStore listens on it seconds later, after Ray has started them. Port 0 draws from the
kernel's ephemeral range, which every outgoing connection on the host draws from too (gloo's
pair connections, Ray's, vLLM's), so in that window another process can hold the port and the
store fails with ``EADDRINUSE``. The kernel never hands out a port below that range on its own:
a port chosen there, at a random place so that two runs on one host rarely meet, stays free
unless someone asks for it by number.
"""

from __future__ import annotations

import socket

def listen_port_range(rng=None, ephemeral_range_file="/proc/sys/net/ipv4/ip_local_port_range",
                      lowest=20000, span=64):
    """``[start, start + span)`` between ``lowest`` and the kernel's ephemeral range, at a random
    start; None when the ephemeral range leaves no room below it (then port 0 is all there is).

    ``lowest`` sits above Ray's worker ports (10002 to 19999 by default). Self-contained: fork
    patch ``verl/0005`` carries this source into verl's Ray worker group.
    """
    import random

    try:
        with open(ephemeral_range_file, encoding="ascii") as ranges:
            first_ephemeral = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    if first_ephemeral - span < lowest:
        return None
    start = (rng or random.SystemRandom()).randint(lowest, first_ephemeral - span)
    return [start, start + span]


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_listen_port(rng=None, **where) -> int:
    """A port that binds now, from :func:`listen_port_range` (port 0's pick when there is no room)."""
    span = listen_port_range(rng, **where)
    if span is not None:
        for port in range(*span):
            if _bindable(port):
                return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
