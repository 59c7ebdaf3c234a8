"""Ray Train's TorchTrainer without two helper actors that a raylora run does not use.

Ray 2.60 starts, for every run, besides the controller, the workers and the synchronisation actor:

- a dataset manager (``DatasetsCallback``), even with no Ray Dataset to split. A run of prepared packs has none
  (each worker reads its share from Ray's object store, :mod:`raylora.data.packs`); a streamed run keeps it.
- a detached placement-group cleaner (``PlacementGroupCleanerCallback``), which removes the workers' placement
  group if the controller dies without doing so. The controller's group belongs to the job that started the run, so
  it goes when that job ends; within a sweep, whose trials Tune ends by killing their controllers, raylora removes a
  finished trial's group itself (``raylora.tune.sweep._release_placement_groups``). The controller also waits for the
  cleaner to start (``ray.get`` on its registration) before its workers train.

Each is a Ray worker process of its own: 1.3 and 1.6 CPU-s a run on 2 cores (read from ``/proc`` over 4 tiny runs),
and like every idle Ray process it wakes every 10 ms beside the training threads (``bench/ray_helpers.py``). Ray
offers no setting for either, so this subclass filters the callback list Ray builds (``_create_default_callbacks``,
Ray's own name for it; ``tests/unit/test_train_lean.py`` pins the two callbacks' names).
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer


class LeanTorchTrainer(TorchTrainer):
    """A ``TorchTrainer`` that starts no placement-group cleaner, nor a dataset manager when it has no datasets."""

    def _create_default_callbacks(self):
        unused = {"PlacementGroupCleanerCallback"} | (set() if self.datasets else {"DatasetsCallback"})
        return [c for c in super()._create_default_callbacks() if type(c).__name__ not in unused]
