"""Connecting to Ray: the cluster in RAY_ADDRESS (as under ``ray job submit``), else a local one on 127.0.0.1."""

from __future__ import annotations

import os

import ray


def ensure_ray() -> None:
    """Start or join Ray once per process; a local cluster binds to 127.0.0.1 and logs no usage stats.

    A local cluster starts its dashboard (on 127.0.0.1, port 8265 or the next free one): Ray Train leaves a
    placement-group cleaner actor behind each run whose controller ends abruptly, as a sweep's stopped
    trials do, and that actor only exits once the dashboard's state API tells it the controller is gone.
    Without it, every trial of a sweep left a 200 MB process polling until Ray shut down.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=True, log_to_driver=True)
