import shutil
import tempfile

import pytest
import ray

from raylora.cluster import ensure_ray, stop_cluster


@pytest.fixture(scope="module")
def ray_session(_ray_for_this_process):
    """A local Ray on 127.0.0.1, shared by the test modules this process runs in turn: starting one costs about 10 s
    of CPU (its dashboard alone is ten processes), and the suite is CPU-bound. A module that ends this process's Ray
    (a test that builds a cluster of its own) leaves the next one to start another, and so does one that left
    something holding CPUs (a test that failed midway): each module starts with every CPU free."""
    if ray.is_initialized() and ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        ray.shutdown()
    ensure_ray()
    yield


@pytest.fixture
def session_address(ray_session) -> str:
    """The module's shared cluster, for a command a test runs in a process of its own (``RAY_ADDRESS``): a command
    that started a cluster of its own paid about 9 s of CPU for it, and the suite is CPU-bound."""
    return ray.get_runtime_context().gcs_address


@pytest.fixture
def ray_tmp() -> str:
    """A short folder under /tmp for a test's own Ray cluster (Ray's socket paths must fit in 107 bytes); after the
    test, whatever of that cluster still runs is stopped and the folder removed."""
    folder = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    yield folder
    stop_cluster(folder)
    shutil.rmtree(folder, ignore_errors=True)
