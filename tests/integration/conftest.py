import shutil
import tempfile

import pytest
import ray

from raylora.cluster import ensure_ray, stop_cluster


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray on 127.0.0.1 per test module (starting Ray costs seconds)."""
    ensure_ray()
    yield
    ray.shutdown()


@pytest.fixture
def ray_tmp() -> str:
    """A short folder under /tmp for a test's own Ray cluster (Ray's socket paths must fit in 107 bytes); after the
    test, whatever of that cluster still runs is stopped and the folder removed."""
    folder = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    yield folder
    stop_cluster(folder)
    shutil.rmtree(folder, ignore_errors=True)
