import pytest

from raylora.config import load_config
from raylora.train.cpus import free_share
from raylora.train.fit import worker_cpus_line


@pytest.mark.parametrize(
    ("nodes", "available", "workers", "device", "reserve", "expected"),
    [
        ([{"CPU": 2}], 2, 1, None, 0, 2),  # the lone worker of a 2-core laptop takes both cores
        ([{"CPU": 2}], 2, 2, None, 0, 1),
        ([{"CPU": 2}], 2, 1, None, 1, 1),  # a streamed pipeline keeps one for its readers
        ([{"CPU": 8}, {"CPU": 8}], 16, 3, None, 0, 4),  # 5 each would fit only 2 of the 3 workers on the 2 nodes
        ([{"CPU": 192, "NPU": 8}, {"CPU": 192, "NPU": 8}], 384, 16, "NPU", 0, 24),  # 8 NPU workers a node
        ([{"CPU": 192, "NPU": 8}], 40, 8, "NPU", 0, 5),  # other jobs hold most of the node's CPUs
        ([{"CPU": 1}], 1, 4, None, 0, 1),  # never below one: Ray then says the workers do not fit
    ],
)
def test_workers_share_the_free_cpus_and_all_fit(nodes, available, workers, device, reserve, expected):
    assert free_share(nodes, available, workers, device, reserve) == expected


def test_the_start_up_line_says_what_each_worker_got_and_why():
    cfg = load_config(None, ["train.cpus_per_worker=2", "train.num_workers=1"])
    assert worker_cpus_line(cfg, unset=True) == (
        "workers: 1, each with 2 CPUs and 2 torch threads: the cluster's free CPUs shared by the workers "
        "(train.cpus_per_worker unset)"
    )
    assert worker_cpus_line(cfg, unset=False).endswith("2 torch threads: train.cpus_per_worker")


def test_cpus_per_worker_is_unset_by_default():
    assert load_config(None, []).train.cpus_per_worker is None
