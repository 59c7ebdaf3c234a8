"""Two jobs sharing data.output_dir: found by use, they deleted each other's files mid-way (FileNotFoundError)."""

import json
import subprocess
import sys
import time

import pytest

from raylora.config import load_config
from raylora.data import pipeline
from raylora.data.sources import DataError

HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "w")
fcntl.flock(f, fcntl.LOCK_SH if sys.argv[2] == "read" else fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _hold(path, how: str, seconds: float) -> subprocess.Popen:
    """Another process holding ``path``'s lock, as another raylora job would."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), how, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_job_waits_while_another_prepares_and_does_not_rewrite_what_another_reads(tmp_path, root, monkeypatch):
    monkeypatch.chdir(root)
    monkeypatch.setattr("raylora.cluster.ensure_ray", lambda: pytest.fail("the data was going to be rewritten"))
    out = tmp_path / "data"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"fingerprint": "other settings", "complete": True}))
    (out / "shards").mkdir()
    cfg = load_config("configs/tiny_lora_cpu.yaml", [f"data.output_dir={out}"])
    preparing = _hold(out / ".prepare.lock", "write", 1.5)
    reading = _hold(out / ".readers.lock", "read", 60)
    said, start = [], time.monotonic()
    try:
        with pytest.raises(DataError, match="another running raylora job reads"):
            pipeline.prepare(cfg, log=said.append)
    finally:
        reading.kill()
        preparing.wait()
    assert said == [f"waiting for another raylora process preparing {out}"] and time.monotonic() - start > 1
    assert (out / "shards").is_dir() and (out / "manifest.json").is_file()  # nothing of the reader's was deleted
