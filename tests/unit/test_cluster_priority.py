"""Ray starts workers at niceness 15; a training thread lowers its own to 0 before torch starts its threads."""

import os
import threading

from raylora.cluster import normal_priority


def _in_thread(niceness: int) -> dict:
    """normal_priority() on a fresh thread whose niceness was raised to ``niceness`` first, as a Ray worker's."""
    seen: dict = {}

    def body():
        os.setpriority(os.PRIO_PROCESS, 0, niceness)  # raising one's own niceness needs no privilege
        seen["note"] = normal_priority()
        seen["after"] = os.getpriority(os.PRIO_PROCESS, 0)
        child = threading.Thread(target=lambda: seen.update(child=os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return seen


def test_a_niced_training_thread_and_the_threads_it_starts_run_at_zero_where_allowed():
    seen = _in_thread(15)
    if seen["note"] == "niceness 15 -> 0 (Ray starts workers at 15)":
        assert seen["after"] == seen["child"] == 0
    else:  # no privilege to lower niceness: the note says how to start Ray instead
        assert "RAY_worker_niceness=0" in seen["note"] and seen["after"] == seen["child"] == 15
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the test's own thread was never touched


def test_a_thread_already_at_zero_is_left_as_it_is():
    assert _in_thread(0)["note"] == "niceness 0"
