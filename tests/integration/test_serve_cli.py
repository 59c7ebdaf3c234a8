"""`raylora serve` as a user runs it: ready, answering, and stopped cleanly by Ctrl-C or SIGTERM."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from processes import alive, cluster_processes

from raylora.ports import free_port, port_holder

RAYLORA = str(Path(sys.executable).with_name("raylora"))


def test_serve_stops_cleanly_on_a_signal(tmp_path, ray_tmp):
    """SIGTERM, as `ray job stop` and schedulers send it; Ctrl-C (SIGINT) takes the same handler (serve_forever),
    checked with real signals in tests/unit/test_serve_stop.py, so CI runs the 30-s server start once."""
    signum = signal.SIGTERM
    port = free_port()
    proc = subprocess.Popen(
        [RAYLORA, "serve", "configs/tiny_serve_cpu.yaml", f"serve.port={port}",
         f"serve.adapter_root={tmp_path / 'adapters'}", "serve.cpus_per_replica=0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_TMPDIR": str(ray_tmp)},
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "is ready" in line:
                break
        assert "is ready" in lines[-1], "".join(lines[-30:])
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3, "temperature": 0}
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert cluster_processes(ray_tmp), "the server's Ray processes should be found by their temp folder"
        proc.send_signal(signum)
        rest = proc.communicate(timeout=90)[0]
        assert proc.returncode == 0, rest[-3000:]
        assert "stopping" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while alive(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(ray_tmp) == []
    assert port_holder("127.0.0.1", port) is None
