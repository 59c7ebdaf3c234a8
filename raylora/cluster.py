"""Connecting to Ray: the cluster in RAY_ADDRESS (as under ``ray job submit``), else a local one on 127.0.0.1."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import psutil
import ray
from ray._private.utils import read_ray_address


def ensure_ray() -> None:
    """Start or join Ray once per process: the cluster in RAY_ADDRESS, else the last ``ray start`` on this host
    (whatever address it listens on), else (or with RAY_ADDRESS=local, or when that ``ray start`` is gone: Ray would
    wait for it) a new local cluster on 127.0.0.1 that logs no usage stats.

    The new cluster stays on loopback because importing raylora, before Ray, turned off Ray's switch of a node's
    127.0.0.1 to the host's routable address (``raylora/__init__.py``). It starts its dashboard (on 127.0.0.1,
    port 8265 or the next free one), where users watch their runs and through which Ray's state API answers (Ray
    Train's placement-group cleaner, which raylora's runs no longer start, :mod:`raylora.train.lean`, polled it).
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address, passed_over = cluster_to_join()
    if passed_over:
        print(passed_over, file=sys.stderr)
    if address is not None:
        ray.init(address=address, log_to_driver=True)
        return
    # Ray's state API finds "the" cluster of the host by its last `ray start` or, failing that, by the only GCS
    # process it sees: with another Ray instance on the host, its callers (Ray Train's placement-group cleaner, in
    # every run before raylora.train.lean) failed with a traceback ("Found multiple active Ray instances"). The new
    # cluster's processes take this one's environment as ray.init starts them, so it tells them where their
    # dashboard is, for them alone: the variable wins over any address, so it must not reach a `ray job submit` this
    # process runs later.
    with dashboard_port() as port:
        previous = os.environ.get("RAY_API_SERVER_ADDRESS")
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        try:
            ray.init(address="local", include_dashboard=True, dashboard_port=port, log_to_driver=True)
        finally:
            if previous is None:
                del os.environ["RAY_API_SERVER_ADDRESS"]
            else:
                os.environ["RAY_API_SERVER_ADDRESS"] = previous


@contextlib.contextmanager
def _host_lock(name: str) -> Iterator[None]:
    """Within: no other process of this host holds the lock ``name`` (a file in the temp folder; released when the
    holder exits, however it exits)."""
    with open(Path(tempfile.gettempdir()) / name, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def dashboard_port() -> Iterator[int]:
    """A dashboard port for a cluster started within the block (``ray.init`` or ``ray start``): Ray's default, 8265,
    or the next one free on 127.0.0.1, as Ray itself picks it. No other raylora process of the host picks one until
    the block ends: picked by two at once, both took 8265 and the second cluster came up without a dashboard."""
    with _host_lock("raylora-ray-init.lock"):
        yield _free_dashboard_port()


def _free_dashboard_port() -> int:
    for port in range(8265, 8315):
        with socket.socket() as s:
            with contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port))
                return port
    raise OSError("ports 8265-8314 are all taken; stop another Ray dashboard or set RAY_ADDRESS")


def cluster_to_join() -> tuple[str | None, str | None]:
    """``(address, note)``: the running cluster :func:`ensure_ray` joins (``None``: it starts a new one), and why
    the last ``ray start`` on this host is passed over, if it is."""
    address = os.environ.get("RAY_ADDRESS") or None
    if address == "local":
        return None, None
    if address not in (None, "auto"):
        return address, None
    recorded = last_ray_start()
    if address is None and recorded and (why := unanswered(recorded)):
        return None, (
            f"raylora: the last `ray start` on this host ({recorded}) does not answer ({why}); starting a local "
            "cluster instead (`ray stop` makes Ray forget it)"
        )
    return recorded or address, None


def last_ray_start() -> str | None:
    """The address the last ``ray start`` on this host recorded in Ray's temp folder (``ray stop`` clears it)."""
    address = read_ray_address()
    return address if address not in (None, "", "local", "auto") else None


def unanswered(address: str) -> str | None:
    """Why a Ray address (``host:port``, or a ``ray://`` or ``http://`` URL) takes no TCP connection within 2 s;
    ``None`` when it does."""
    parsed = urlparse(address if "://" in address else f"ray://{address}")
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=2):
            return None
    except OSError as e:
        return e.strerror or str(e)


@contextlib.contextmanager
def sigterm_stops(before: Callable[[], None]) -> Iterator[None]:
    """Within: SIGTERM (``ray job stop``, a scheduler) runs ``before`` (marking the MLflow run KILLED: ``ray job
    stop`` kills the process a few seconds later) and then stops the process the way Ctrl-C does, which Ray Train and
    Tune handle gracefully; where SIGINT is ignored (inherited: a script's background job, whose shell ignores SIGINT
    in it, or a parent inside ``system()``), it raises KeyboardInterrupt as Ctrl-C's default handler would. Signals
    reach only the main thread: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_) -> None:
        try:
            before()
        except Exception as e:  # the store unreachable: stopping matters more
            print(f"could not mark the MLflow run stopped: {e}", file=sys.stderr)
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # the SIGINT sent below would be dropped
            raise KeyboardInterrupt
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # Ray starts job entrypoints with SIGINT blocked
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def stop_cluster(temp_dir: str) -> None:
    """Stop the processes of the cluster whose Ray files are in ``temp_dir`` (never another cluster's): those whose
    command line names it or its GCS address (the Ray client server), and whatever its raylets started (their agents
    rename themselves and would outlive them), never the calling process or its ancestors; SIGTERM, then SIGKILL after
    5 s (the GCS server and the raylet ignored SIGTERM for 10-20 s)."""
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    client_server = None  # `ray start --head` also starts a Ray client server, which names only the GCS address
    with contextlib.suppress(OSError):
        client_server = (
            f"ray.util.client.server --address={(Path(temp_dir) / 'ray_current_cluster').read_text().strip()} "
        )
    ours = {}
    for p in psutil.process_iter(["cmdline", "name"]):
        command = " ".join(p.info["cmdline"] or []) + " "
        mine = temp_dir in command or (client_server is not None and client_server in command)
        if mine and p.pid not in spared:
            ours[p.pid] = p
            if p.info["name"] == "raylet":
                with contextlib.suppress(psutil.Error):
                    ours.update((c.pid, c) for c in p.children(recursive=True) if c.pid not in spared)
    for p in ours.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(list(ours.values()), timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
