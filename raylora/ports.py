"""Ports on this machine: who holds one, and free ones for the servers and clusters raylora starts."""

from __future__ import annotations

import random
import socket

import psutil


def port_holder(host: str, port: int) -> str | None:
    """What listens on ``host:port``: ``None`` when the port is free, else the process (pid and command line)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no holder
        try:
            s.bind((host, port))
            return None
        except OSError:
            pass
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            try:
                command = " ".join(psutil.Process(conn.pid).cmdline())
            except psutil.Error:
                command = "?"
            return f"process {conn.pid} ({command[:160]})"
    return "another process"


_GIVEN: set[int] = set()  # ports free_port has handed out (or was told to keep off) in this process


def reserve(port: int) -> None:
    """Keep ``free_port`` off ``port`` in this process: a port a later step binds (the demo's serve port, picked by
    whoever started the demo, must not go to the Ray cluster the demo starts first)."""
    _GIVEN.add(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to, drawn at random from 20000-29999 and not handed out before in this process.

    Not a port the kernel picks (binding port 0): those come from the ephemeral range (32768-60999 on Linux), where
    Ray's own processes bind theirs too, so a Ray process started after the pick can take it first. 20000-29999
    lies between Ray's worker ports (10002-19999) and that range.
    Raises:
        OSError: every port tried is taken.
    """
    draws = random.Random()
    for port in draws.sample(range(20000, 30000), 500):
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise OSError(f"no free port on {host} in 20000-29999 after 500 tries")
