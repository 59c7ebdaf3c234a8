"""Starting the server: checks before the cluster, then ``serve.run`` on the chosen engine."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from raylora.config import JobConfig
from raylora.data.sources import DataError, plan_sources

APP_NAME = "raylora"


class ServeSetupError(ValueError):
    """Problems found before the cluster is touched; the message lists every one."""


def check_serve(cfg: JobConfig) -> list[str]:
    """Every problem that would stop ``cfg`` from serving, found without touching the cluster."""
    from raylora.backends import BackendError, planned_backend

    problems = []
    try:
        backend = planned_backend(cfg.backend)
    except BackendError as e:
        return [str(e)]
    if cfg.serve.engine == "vllm":
        from raylora.serve.vllm import check_vllm_config

        return check_vllm_config(cfg, backend)
    if cfg.serve.quantization == "w8a8-smoothquant":
        if not cfg.data.sources:
            problems.append(
                "serve.quantization=w8a8-smoothquant calibrates on data.sources: name at least one data file"
            )
        else:
            try:
                plan_sources(cfg.data)
            except DataError as e:
                problems.append(f"serve.quantization=w8a8-smoothquant calibrates on data.sources, which has {e}")
    root = Path(cfg.serve.adapter_root)
    if root.exists() and not root.is_dir():
        problems.append(f"serve.adapter_root={root} is a file; it must be a folder of adapters")
    problems += _model_problems(cfg)
    holder = port_holder(cfg.serve.host, cfg.serve.port)
    if holder and not redeploys(cfg.serve.port):
        # Ray Serve's proxy listens with SO_REUSEPORT: a second server would not fail, it would share the port.
        problems.append(
            f"port {cfg.serve.host}:{cfg.serve.port} is taken by {holder}; stop that server, or choose another "
            "port with serve.port=PORT"
        )
    return problems


def redeploys(port: int) -> bool:
    """Whether ``port`` is held by the Serve proxy of the very cluster this command joins, where ``serve.run``
    replaces the application in place (any other holder, a new cluster's proxy included, would share the port)."""
    from raylora.cluster import cluster_to_join

    joined, _ = cluster_to_join()
    proxy = serve_proxy_cluster(port)
    return bool(joined and proxy and same_address(joined, proxy))


def serve_proxy_cluster(port: int) -> str | None:
    """The GCS address of the Ray cluster whose Serve proxy listens on ``port`` on this host, if one does: the
    ``--gcs-address`` of the raylet that started the proxy's process."""
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.laddr.port != port or not conn.pid:
            continue
        with contextlib.suppress(psutil.Error):
            proxy = psutil.Process(conn.pid)
            if "ProxyActor" not in " ".join(proxy.cmdline()):
                continue
            for parent in proxy.parents():
                args = parent.cmdline()
                if args and os.path.basename(args[0]) == "raylet":
                    return next((a.split("=", 1)[1] for a in args if a.startswith("--gcs-address=")), None)
    return None


def same_address(a: str, b: str) -> bool:
    """Whether two Ray GCS addresses (``host:port``) name the same port of one host; any two names of this host
    (127.0.0.1, its hostname, an interface's address) count as one. A Ray Client address (``ray://``) names another
    port and never matches."""
    import psutil

    first, second = (urlparse(x if "://" in x else f"//{x}") for x in (a, b))
    if "ray" in (first.scheme, second.scheme):
        return False
    try:
        hosts = {socket.gethostbyname(first.hostname or ""), socket.gethostbyname(second.hostname or "")}
        if first.port != second.port:
            return False
    except (OSError, ValueError):
        return False
    here = {a.address for addresses in psutil.net_if_addrs().values() for a in addresses}
    return len(hosts) == 1 or all(h.startswith("127.") or h in here for h in hosts)


def port_holder(host: str, port: int) -> str | None:
    """What listens on ``host:port``: ``None`` when the port is free, else the process (pid and command line)."""
    import psutil

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no holder
        try:
            s.bind((host, port))
            return None
        except OSError:
            pass
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            try:
                command = " ".join(psutil.Process(conn.pid).cmdline())
            except psutil.Error:
                command = "?"
            return f"process {conn.pid} ({command[:160]})"
    return "another process"


_GIVEN: set[int] = set()  # ports free_port has handed out in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to, drawn at random from 20000-29999 and not handed out before in this process.

    Not a port the kernel picks (binding port 0): those come from the ephemeral range (32768-60999 on Linux), where
    Ray's own processes bind theirs too, so a Ray process started after the pick can take it first. 20000-29999
    lies between Ray's worker ports (10002-19999) and that range.
    Raises:
        OSError: every port tried is taken.
    """
    draws = random.Random()
    for port in draws.sample(range(20000, 30000), 500):
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise OSError(f"no free port on {host} in 20000-29999 after 500 tries")


def _model_problems(cfg: JobConfig) -> list[str]:
    from raylora.model_files import INT8_MANIFEST, TINY, ModelError, model_folder

    if cfg.model.name_or_path in TINY:
        return []
    try:
        folder = model_folder(cfg.model)
    except ModelError as e:
        return [str(e)]
    if (folder / INT8_MANIFEST).is_file() and cfg.serve.quantization != "none":
        return [f"model.name_or_path={folder} is already int8 (raylora export); set serve.quantization=none"]
    return []


def start(cfg: JobConfig, detach: bool = False) -> str:
    """Deploy the application on the current Ray cluster (started on 127.0.0.1 if none); returns its base URL.

    Args:
        detach: the caller returns at once, so the app must live in a cluster that outlives it (not one this
            process starts: that cluster ends with it).
    Raises:
        ServeSetupError: listing every problem :func:`check_serve` found, before any Ray process starts.
    """
    from raylora.cluster import cluster_to_join

    problems = check_serve(cfg)
    if detach and cluster_to_join()[0] is None:
        problems.append(
            "--detach returns at once, and this command would start its own Ray cluster (no RAY_ADDRESS, no running "
            "`ray start`), which ends with it: start one first (`ray start --head --node-ip-address=127.0.0.1`), "
            "or serve without --detach"
        )
    if problems:
        raise ServeSetupError("cannot serve:\n  - " + "\n  - ".join(problems))
    from ray import serve

    from raylora.cluster import ensure_ray

    ensure_ray()
    Path(cfg.serve.adapter_root).mkdir(parents=True, exist_ok=True)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    if cfg.serve.engine == "vllm":
        from raylora.backends import planned_backend
        from raylora.serve.vllm import build_vllm_app

        app = build_vllm_app(cfg, planned_backend(cfg.backend))
    else:
        from raylora.serve.app import build_app

        app = build_app(cfg)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{cfg.serve.host}:{cfg.serve.port}"


def wait_for_interrupt(poll: float = 0.5) -> None:
    """Sleep until a signal handler raises (KeyboardInterrupt), waking every ``poll`` seconds.

    Python runs signal handlers on the main thread only when it runs bytecode, and the kernel may deliver a
    process's SIGINT or SIGTERM to any of its threads (Ray's driver has dozens): then a long sleep of the main
    thread is not interrupted, and ``raylora serve`` ignored Ctrl-C for up to its whole length."""
    while True:
        time.sleep(poll)


def serve_forever(cfg: JobConfig) -> None:
    """``raylora serve``: deploy, print how to call it, and serve until Ctrl-C or SIGTERM, then stop cleanly."""
    import ray
    from ray import serve

    url = start(cfg)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)  # whatever handler Ray or a library left for Ctrl-C
    print(f"raylora serve: {url}/v1 is ready (OpenAI API; GET {url}/v1/models lists the base and adapters). "
          "Ctrl-C stops it.", flush=True)  # fmt: skip
    try:
        wait_for_interrupt()
    except KeyboardInterrupt:
        print("raylora serve: stopping", flush=True)
        serve.delete(APP_NAME)
        serve.shutdown()
        ray.shutdown()
