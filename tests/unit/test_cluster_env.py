"""Importing raylora keeps a local cluster on loopback, and leaves a driver of a remote cluster alone.

Each case is a fresh interpreter: Ray reads the switch once, when it is first imported.
"""

import os
import subprocess
import sys

import pytest

SWITCH = "os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER')"


def _fresh(code: str, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, "0"),
        ({"RAY_ADDRESS": "local"}, "0"),
        ({"RAY_ADDRESS": "127.0.0.1:6379"}, "None"),
        ({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}, "1"),
    ],
)
def test_import_sets_the_loopback_switch_only_for_a_local_cluster(extra, expected):
    assert _fresh(f"import os, raylora; print({SWITCH})", **extra) == expected


def test_ray_imported_after_raylora_keeps_127_0_0_1_on_loopback():
    """Whatever addresses the host has: Ray's switch is off, and 127.0.0.1 stays 127.0.0.1."""
    code = (
        "import raylora, ray; from ray._private import ray_constants, services; "
        "print(ray_constants.ENABLE_RAY_CLUSTER, services.resolve_ip_for_localhost('127.0.0.1'))"
    )
    assert _fresh(code) == "False 127.0.0.1"


def test_where_ray_came_first_the_switch_is_left_alone():
    assert _fresh(f"import os, ray, raylora; print({SWITCH})") == "None"
