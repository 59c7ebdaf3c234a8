"""Stopping the Ray processes a test started itself, found by the temp folder it gave them, by PID."""

import signal

import psutil


def stop_processes(marker: str) -> None:
    """SIGTERM every process whose command line holds ``marker`` (a test's own Ray temp folder), then SIGKILL."""
    ours = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    for p in ours:
        p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(ours, timeout=15)
    for p in alive:
        p.kill()
