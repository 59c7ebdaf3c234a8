"""The hidden share of the all-reduce, read from trace events, on known timelines."""

import pytest

from raylora.comm.overlap import hidden_share

BW = "autograd::engine::evaluate_function: MmBackward0"


def test_a_collective_inside_backward_is_hidden_and_one_after_it_is_exposed():
    events = [
        ("DistributedDataParallel.forward", 0, 10),
        ("gloo:all_reduce", 5, 8),  # the no_sync micro-batch's time: before the synchronising backward, ignored
        (BW, 10, 20), (BW, 20, 30), (BW, 35, 40),
        ("gloo:all_reduce", 25, 37),  # 5 inside [20, 30], 2 inside [35, 40], 5 in the gap
        ("gloo:all_reduce", 40, 48),  # the last bucket: after backward, all exposed
        ("gloo:all_reduce", 50, 51),  # the loop's loss all-reduce, after DDP wrote the gradients back: ignored
    ]  # fmt: skip
    share = hidden_share(events, backward_from=10, backward_until=49)
    assert share == pytest.approx(
        {"comm_collectives": 2, "comm_ms": 20e-3, "comm_hidden_ms": 7e-3, "comm_hidden_fraction": 7 / 20}
    )


def test_collectives_on_two_gloo_threads_count_once_where_they_overlap():
    events = [(BW, 0, 10), ("gloo:all_reduce", 2, 6), ("gloo:all_reduce", 4, 12)]
    share = hidden_share(events, backward_from=0)
    assert share["comm_ms"] == pytest.approx(10e-3) and share["comm_hidden_fraction"] == pytest.approx(0.8)


def test_a_trace_without_gloo_collectives_measures_nothing():
    # NCCL and HCCL run collectives on device streams: the host trace has only their launches
    assert hidden_share([(BW, 0, 10), ("nccl:all_reduce", 9, 10)], backward_from=0) is None
