"""Importing raylora keeps a local cluster on loopback, and leaves a driver of a remote cluster alone."""

import os
import subprocess
import sys

import pytest

PRINT = "import os, raylora; print(os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'))"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, "0"),
        ({"RAY_ADDRESS": "127.0.0.1:6379"}, "None"),
        ({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}, "1"),
    ],
)
def test_import_sets_the_loopback_switch_only_for_a_local_cluster(extra, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", PRINT], env={**env, **extra}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected
