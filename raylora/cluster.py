"""Connecting to Ray: the cluster in RAY_ADDRESS (as under ``ray job submit``), else a local one on 127.0.0.1."""

from __future__ import annotations

import os
import sys

import ray


def ensure_ray() -> None:
    """Start or join Ray once per process; a local cluster binds to 127.0.0.1 and logs no usage stats.

    The local cluster stays on loopback only if Ray was first imported after raylora (see ``raylora/__init__``);
    if not, this says so on stderr.

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
        node = ray.util.get_node_ip_address()
        if node != "127.0.0.1":
            print(
                f"warning: Ray started this local cluster on {node}, not 127.0.0.1: ray was imported before raylora "
                "(which sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); import raylora first or set that variable",
                file=sys.stderr,
            )


def normal_priority() -> str:
    """Run the calling thread, and the threads it starts from then on (torch's intra-op team among them), at
    niceness 0.

    Ray starts its workers at niceness 15 (the raylet's ``RAY_worker_niceness``). A niced intra-op thread yields
    its core to any other process that wakes, the driver or Ray's own daemons, and every other thread of the
    team waits for it at the end of each op: on 2 cores the shipped SmolLM2 job trained at about 0.92x the speed
    (``bench/train_throughput.py``, 277-280 against 297-302 tokens/s). Lowering niceness needs the privilege to
    (root, or ``RLIMIT_NICE``); without it, starting Ray with ``RAY_worker_niceness=0`` does the same.

    Returns:
        A note for the training path: the niceness found, and what became of it.
    """
    found = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: the calling thread's
    if found <= 0:
        return f"niceness {found}"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        return f"niceness {found}, Ray's default for workers (RAY_worker_niceness=0 when starting Ray trains at 0)"
    return f"niceness {found} -> 0 (Ray starts workers at {found})"
