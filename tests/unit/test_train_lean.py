"""The TorchTrainer every raylora run fits: Ray Train's own callbacks, less the two helper actors it does not need."""

import ray.data
import ray.train
from ray.train.torch import TorchTrainer

from raylora.train.lean import LeanTorchTrainer


def _names(trainer) -> list[str]:
    return [type(c).__name__ for c in trainer._create_default_callbacks()]


def _trainer(cls, **datasets):
    return cls(lambda config: None, scaling_config=ray.train.ScalingConfig(num_workers=1), datasets=datasets or None)


def test_a_run_of_prepared_packs_starts_neither_a_dataset_manager_nor_a_placement_group_cleaner():
    ours, theirs = _names(_trainer(LeanTorchTrainer)), _names(_trainer(TorchTrainer))
    # the two Ray starts for every run, each a process of its own (the test pins them: a Ray upgrade that renames
    # them must be read again)
    assert {"DatasetsCallback", "PlacementGroupCleanerCallback"} <= set(theirs)
    assert ours == [n for n in theirs if n not in ("DatasetsCallback", "PlacementGroupCleanerCallback")]


def test_a_streamed_run_keeps_the_dataset_manager_that_splits_its_datasets():
    streamed = ray.data.range  # a dataset as a callable Ray Train calls on the controller: no cluster here
    ours, theirs = _names(_trainer(LeanTorchTrainer, train=streamed)), _names(_trainer(TorchTrainer, train=streamed))
    assert ours == [n for n in theirs if n != "PlacementGroupCleanerCallback"] and "DatasetsCallback" in ours
