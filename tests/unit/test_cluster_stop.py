"""stop_cluster stops every process of one cluster and nothing of another's."""

import subprocess
import sys

from raylora.cluster import stop_cluster


def _fake(*argv: str) -> subprocess.Popen:
    """A process whose command line reads like a Ray process's (``python -c ... <argv>``)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *argv])


def test_the_ray_client_server_of_the_cluster_is_stopped_and_another_clusters_is_not(tmp_path):
    """Found by use: `ray start --head` starts a Ray client server that is neither a raylet's child nor names the
    temporary folder, so every demo (and every test's own cluster) left one running."""
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:26379")
    ours = _fake("-m", "ray.util.client.server", "--address=127.0.0.1:26379", "--port=26380")
    theirs = _fake("-m", "ray.util.client.server", "--address=127.0.0.1:36379", "--port=36380")
    try:
        stop_cluster(str(tmp_path))
        assert ours.wait(timeout=10) is not None
        assert theirs.poll() is None
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
