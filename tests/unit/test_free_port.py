"""free_port: ports outside the kernel's ephemeral range, where Ray's own processes bind theirs."""

import random
import socket

from raylora import ports
from raylora.ports import free_port, reserve


def test_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= p < 30000 and p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_held_port_is_never_handed_out():
    held = []
    try:
        for port in range(20000, 30000, 2):  # half the range held: every pick must come from the other half
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        picks = [free_port() for _ in range(20)]
        assert all(p % 2 == 1 for p in picks), picks
    finally:
        for s in held:
            s.close()


def test_a_reserved_port_is_never_handed_out(monkeypatch):
    # the demo's serve port, chosen by its caller in another process, went to the demo's Ray cluster once
    port = free_port() + 1
    while port in ports._GIVEN:
        port += 1
    reserve(port)
    monkeypatch.setattr(random.Random, "sample", lambda self, population, k: [port, port + 1])
    assert free_port() == port + 1
