"""Starting the server: checks before the cluster, then ``serve.run`` on the chosen engine."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import ray
from ray import serve

from raylora.backends import BackendError, planned_backend
from raylora.cluster import cluster_to_join, ensure_ray
from raylora.config import JobConfig
from raylora.data.sources import DataError, plan_sources
from raylora.errors import BadInput
from raylora.model_files import INT8_MANIFEST, TINY, ModelError, model_folder
from raylora.ports import port_holder
from raylora.serve.app import build_app
from raylora.serve.vllm import build_vllm_app, check_vllm_config

APP_NAME = "raylora"


class ServeSetupError(BadInput, ValueError):
    """Problems found before the cluster is touched; the message lists every one."""


def check_serve(cfg: JobConfig) -> list[str]:
    """Every problem that would stop ``cfg`` from serving, found without touching the cluster."""
    problems = []
    try:
        backend = planned_backend(cfg.backend)
    except BackendError as e:
        return [str(e)]
    if cfg.serve.engine == "vllm":
        return check_vllm_config(cfg, backend)
    if cfg.serve.quantization == "w8a8-smoothquant":
        if not cfg.data.sources:
            problems.append(
                "serve.quantization=w8a8-smoothquant calibrates on data.sources: name at least one data file"
            )
        else:
            try:
                plan_sources(cfg.data, cfg.train.objective)
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
    joined, _ = cluster_to_join()
    proxy = serve_proxy_cluster(port)
    return bool(joined and proxy and same_address(joined, proxy))


def serve_proxy_cluster(port: int) -> str | None:
    """The GCS address of the Ray cluster whose Serve proxy listens on ``port`` on this host, if one does: the
    ``--gcs-address`` of the raylet that started the proxy's process."""
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


def _model_problems(cfg: JobConfig) -> list[str]:
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
    problems = check_serve(cfg)
    if detach and cluster_to_join()[0] is None:
        problems.append(
            "--detach returns at once, and this command would start its own Ray cluster (no RAY_ADDRESS, no running "
            "`ray start`), which ends with it: start one first (`ray start --head --node-ip-address=127.0.0.1`), "
            "or serve without --detach"
        )
    if problems:
        raise ServeSetupError("cannot serve:\n  - " + "\n  - ".join(problems))
    ensure_ray()
    Path(cfg.serve.adapter_root).mkdir(parents=True, exist_ok=True)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    if cfg.serve.engine == "vllm":
        app = build_vllm_app(cfg, planned_backend(cfg.backend))
    else:
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
    """``raylora serve``: deploy, print how to call it, and serve until Ctrl-C or SIGTERM, then stop cleanly.

    The signals stop it while it starts too: loading and quantising a model takes half a minute, and a Ctrl-C then
    was ignored (Ray's ``ray.init`` replaces the SIGTERM handler, so it is set again once the app runs)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def catch_stop_signals() -> None:
        signal.signal(signal.SIGTERM, interrupt)
        signal.signal(signal.SIGINT, interrupt)  # whatever handler Ray or a library left for Ctrl-C

    catch_stop_signals()
    try:
        url = start(cfg)
        catch_stop_signals()
        print(f"raylora serve: {url}/v1 is ready (OpenAI API; GET {url}/v1/models lists the base and adapters). "
              "Ctrl-C stops it.", flush=True)  # fmt: skip
        wait_for_interrupt()
    except KeyboardInterrupt:
        print("raylora serve: stopping", flush=True)
        if ray.is_initialized():
            serve.delete(APP_NAME)
            serve.shutdown()
            ray.shutdown()
