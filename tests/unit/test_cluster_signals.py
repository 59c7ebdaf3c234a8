"""SIGTERM stops a run the way Ctrl-C does, after marking it, even where Ray started the process with SIGINT blocked."""

import os
import signal
import subprocess
import sys

from raylora.cluster import sigterm_stops


def test_sigterm_marks_then_raises_sigint_even_when_ray_blocked_it():
    """Review: Ray starts a job's entrypoint with SIGINT blocked, so the SIGINT sent on `ray job stop` stayed pending."""
    said = []

    def on_sigint(*_):
        said.append("sigint")

    previous = signal.signal(signal.SIGINT, on_sigint)
    before = signal.getsignal(signal.SIGTERM)  # Ray's own, once a test of this process has started Ray
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with sigterm_stops(lambda: said.append("marked")):
            os.kill(os.getpid(), signal.SIGTERM)
        assert said == ["marked", "sigint"]
        assert signal.getsignal(signal.SIGTERM) is before  # put back
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, previous)


STOPPABLE = """
import signal, sys, time
from raylora.cluster import sigterm_stops
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # as its parent left it: Python installed no Ctrl-C handler
marked = []
try:
    with sigterm_stops(lambda: marked.append("marked")):
        print("ready", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    print("stopped", marked, flush=True)
    sys.exit(1)
"""


def test_sigterm_stops_a_process_started_with_sigint_ignored():
    """Found by use: a job started in the background of a script (a non-interactive shell ignores SIGINT and SIGQUIT in
    it), or by a parent inside ``system()``, inherits SIGINT ignored; the SIGINT that SIGTERM's handler sent itself was
    then dropped, and the demo went on into its sweep after marking its run stopped."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STOPPABLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, out.strip()) == (1, "stopped ['marked']"), err
