"""``raylora serve`` stops on Ctrl-C even when the kernel hands the signal to a thread other than the main one."""

import signal
import threading
import time

import pytest

from raylora.serve import launch
from raylora.serve.launch import wait_for_interrupt


def _timeout(signum, frame):
    raise AssertionError("wait_for_interrupt did not stop within 10 s")


def test_a_sigint_delivered_to_another_thread_stops_the_wait_within_a_poll():
    def interrupt_from_this_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # as the kernel may pick any of Ray's threads

    # serve_forever installs its own handler; earlier tests (Ray's) may have left another one for SIGINT
    previous = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(10)  # the wait wakes every poll, so this fails the test instead of hanging the suite
    try:
        threading.Thread(target=interrupt_from_this_thread, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            wait_for_interrupt(poll=0.5)
        assert time.monotonic() - started < 2.0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGALRM, previous[1])


def test_a_sigint_while_the_server_starts_stops_it(monkeypatch, capsys):
    """Found by use: Ctrl-C while the replica loaded and quantised SmolLM2 (half a minute) was lost; the server came up
    and served until a second Ctrl-C."""
    polls = []

    def slow_start(cfg):  # as serve.run polls until the application runs
        threading.Timer(0.2, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)).start()
        for _ in range(100):
            polls.append(time.monotonic())
            time.sleep(0.1)
        return "http://127.0.0.1:1"

    monkeypatch.setattr(launch, "start", slow_start)
    previous = (
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGTERM),
        signal.signal(signal.SIGALRM, _timeout),
    )
    signal.alarm(10)
    try:
        started = time.monotonic()
        launch.serve_forever(None)
        assert time.monotonic() - started < 2.0 and len(polls) < 20
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        signal.signal(signal.SIGALRM, previous[2])
    out = capsys.readouterr().out
    assert "raylora serve: stopping" in out and "is ready" not in out
