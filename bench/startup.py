"""What a process pays to import the model stacks: with Python's garbage collector paused (raylora's entries) or not.

Ours: the import inside :func:`raylora.startup.gc_paused` (collection off while it imports, what it made frozen
after), as ``raylora`` commands, Ray Train's workers and shared-base group workers import. Baseline: the same
import under Python's default collector. Each sample is a fresh ``python -c`` process that imports one module and
exits normally; the variants alternate, ours first. Per process: the CPU seconds of the import (measured inside)
and of the whole process, start to exit (its resource usage); printed: each process, the medians and the ratios.

    .venv/bin/python bench/startup.py [--runs 5] [--modules raylora.train.loop,raylora.train.fit]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED = "import time; t = time.process_time()\n{body}\nprint(time.process_time() - t)"
BODY = {
    "baseline": "import {module}",
    "ours": "from raylora.startup import gc_paused\nwith gc_paused():\n    import {module}",
}


def one_process(variant: str, module: str) -> tuple[float, float]:
    """CPU seconds of the import and of the whole process that made it."""
    code = TIMED.format(body=BODY[variant].format(module=module))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{variant} {module}: the process failed ({status})")
    return float(out), usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="processes per variant and module")
    parser.add_argument("--modules", default="raylora.train.loop,raylora.train.fit", help="comma-separated")
    args = parser.parse_args()
    for module in args.modules.split(","):
        samples = {"ours": [], "baseline": []}
        for i in range(args.runs):
            for variant in samples:
                samples[variant].append(one_process(variant, module))
                imported, whole = samples[variant][-1]
                print(f"{module} {variant:8s} #{i + 1}: import {imported:.2f} CPU-s, process {whole:.2f} CPU-s")
        medians = {v: [statistics.median(s[k] for s in runs) for k in (0, 1)] for v, runs in samples.items()}
        (oi, op), (bi, bp) = medians["ours"], medians["baseline"]
        print(f"{module}: import {oi:.2f} against {bi:.2f} CPU-s ({bi / oi:.2f}x less), whole process {op:.2f} "
              f"against {bp:.2f} CPU-s ({bp / op:.2f}x less); medians of {args.runs}")  # fmt: skip


if __name__ == "__main__":
    main()
