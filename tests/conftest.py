import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray swaps a 127.0.0.1 node address for the host's routable IP unless this is off; tests stay on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def root() -> Path:
    return ROOT


def pytest_collection_modifyitems(config, items):
    """Tests under tests/integration, tests/device carry their tier's marker without repeating it."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in ("integration", "device"):
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
