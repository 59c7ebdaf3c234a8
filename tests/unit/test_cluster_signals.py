"""SIGTERM stops a run the way Ctrl-C does, after marking it, even where Ray started the process with SIGINT blocked."""

import os
import signal

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
