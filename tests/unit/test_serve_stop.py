"""``raylora serve`` stops on Ctrl-C even when the kernel hands the signal to a thread other than the main one."""

import signal
import threading
import time

import pytest

from raylora.serve.launch import wait_for_interrupt


def test_a_sigint_delivered_to_another_thread_stops_the_wait_within_a_poll():
    def interrupt_from_this_thread():
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # as the kernel may pick any of Ray's threads

    threading.Thread(target=interrupt_from_this_thread, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        wait_for_interrupt(poll=0.5)
    assert time.monotonic() - started < 2.0
