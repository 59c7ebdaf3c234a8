import os
import sys
from pathlib import Path

# Before torch loads anywhere (this process, its Ray workers, the commands it runs): torch's OpenMP threads sleep at
# once when a parallel region ends instead of spinning for the next one. The suite runs two test processes, their
# Ray clusters and the commands they start on 2 cores, so a spinning thread holds a core another process is waiting
# for: the suite took 18 min 2 s with this against 21 min 28 s without (same machine, back to back; docs/testing.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
assert "torch" not in sys.modules, "OMP_WAIT_POLICY must be set before torch loads: it is read once, at load"

# Ray swaps a 127.0.0.1 address for the host's routable IP unless this is off, and reads it once, when it is imported:
# set after `import ray`, a cluster given by RAY_ADDRESS=127.0.0.1:port was dialled at the routable IP (and never
# answered) by this process's `ray.init`. Tests stay on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402

from raylora.startup import gc_paused  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s, so each run's end (or a dead worker) is noticed up to 2 s late.
# Polling every 0.5 s took the suite from 21 to 15 minutes. A slow poll is still no failure (Ray Train fails a worker
# only after 10 minutes of missed polls).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Each Ray Train run starts a preemption watcher actor (a process of its own, 1.2 s of CPU) for spot nodes that can be
# reclaimed; a local test cluster has none, and the suite is CPU-bound.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def _ray_for_this_process():
    """Ray started by this test process is stopped when its last test has run."""
    yield
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _no_ray_unless_asked(request):
    """Before a module (of any folder) none of whose tests asks for ``ray_session``, the Ray of earlier modules stops:
    those tests start or join clusters of their own, or none, and expect this process to be connected to none."""
    here = request.node.path
    if not any(item.path == here and "ray_session" in item.fixturenames for item in request.session.items):
        ray.shutdown()


@pytest.fixture
def root() -> Path:
    return ROOT


# The files that take longest (`make test`'s --durations), longest first. `make test` runs two pytest processes that
# each take whole files in this order, so the long files start at once and the short ones fill the gaps: run last,
# one long file kept a process busy minutes after the other had finished. The files that share their process's Ray
# cluster (`ray_session`) come before those that start clusters of their own or none (the demo aside, the longest):
# a process stops its cluster before such a file, and interleaved, each process started its cluster again and again
# (12 clusters started in one run of the suite before this order, 10 after; about 10 s of CPU each to start).
LONGEST_FIRST = (
    "integration/test_train.py",
    "integration/test_demo.py",
    "integration/test_tune_shared.py",
    "integration/test_preference.py",
    "integration/test_serve.py",
    "integration/test_tune.py",
    "integration/test_prepare.py",
    "integration/test_cluster_address.py",
    "integration/test_doctor_ray.py",
    "integration/test_train_cluster.py",
    "integration/test_smollm2.py",
    "integration/test_serve_cli.py",
    "integration/test_first_conversion.py",
    "integration/test_quickstart.py",
)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules import torch, transformers, peft and Ray: with the garbage collector paused (raylora.startup)."""
    with gc_paused():
        return (yield)


def pytest_collection_modifyitems(config, items):
    """Tests under tests/integration, tests/device carry their tier's marker without repeating it; files run
    longest first (:data:`LONGEST_FIRST`), each file's tests in their written order."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in ("integration", "device"):
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))

    def rank(item) -> int:
        path = Path(str(item.fspath)).as_posix()
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))

    items.sort(key=rank)
