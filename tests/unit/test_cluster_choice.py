"""Which Ray cluster a command joins (``cluster_to_join``), and when a port's Serve proxy is that cluster's."""

import socket

import pytest

from raylora import cluster
from raylora.serve.launch import same_address


@pytest.mark.parametrize(
    ("env", "recorded", "answers", "joined", "noted"),
    [
        (None, None, True, None, False),  # nothing running: a new local cluster
        ("", None, True, None, False),
        ("local", "127.0.0.1:6379", True, None, False),  # told to start one, whatever runs
        (None, "127.0.0.1:6379", True, "127.0.0.1:6379", False),  # the last `ray start` on this host
        (None, "127.0.0.1:6379", False, None, True),  # ... gone without `ray stop`: passed over, saying why
        ("auto", "127.0.0.1:6379", False, "127.0.0.1:6379", False),  # Ray's own "auto" is left to Ray
        ("auto", None, True, "auto", False),
        ("10.0.0.5:6379", "127.0.0.1:6379", True, "10.0.0.5:6379", False),  # RAY_ADDRESS wins (ray job submit)
    ],
)
def test_the_cluster_a_command_joins(monkeypatch, env, recorded, answers, joined, noted):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env is not None:
        monkeypatch.setenv("RAY_ADDRESS", env)
    monkeypatch.setattr(cluster, "last_ray_start", lambda: recorded)
    monkeypatch.setattr(cluster, "unanswered", lambda address: None if answers else "connection refused")
    address, note = cluster.cluster_to_join()
    assert address == joined and bool(note) == noted


def test_names_of_this_host_are_one_host_and_ports_must_match():
    assert same_address("127.0.0.1:6379", "127.0.0.1:6379")
    assert same_address("localhost:6379", "127.0.0.1:6379")
    assert same_address(f"{socket.gethostname()}:6379", "127.0.0.1:6379")  # `ray start` records a routable name
    assert not same_address("127.0.0.1:6380", "127.0.0.1:6379")
    assert not same_address("ray://127.0.0.1:10001", "127.0.0.1:6379")  # Ray Client: another port, another API
    assert not same_address("203.0.113.9:6379", "127.0.0.1:6379")  # another machine (TEST-NET-3)
