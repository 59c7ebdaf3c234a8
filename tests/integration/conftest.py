import pytest
import ray

from raylora.cluster import ensure_ray


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray on 127.0.0.1 per test module (starting Ray costs seconds)."""
    ensure_ray()
    yield
    ray.shutdown()
