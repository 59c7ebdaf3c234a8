"""Counting the bytes each rank hands to collectives, whoever calls them.

PyTorch's hooks call ``dist.all_reduce`` through the ``dist`` name of their own module, some of them later, in
a future's callback. :func:`install` swaps that name (and ours) for a proxy that counts every tensor handed to a
collective before passing the call on, so the bytes of any hook are measured rather than derived from a formula.
Counted is the payload: the bytes of the tensors a rank contributes (``all_reduce``: the whole tensor;
``all_gather``: its own part), per rank; what the wire carries follows from the collective's algorithm
(a ring all-reduce sends ``2 (n - 1) / n`` of the payload, an all-gather ``n - 1`` times it).
"""

from __future__ import annotations

import threading
from types import ModuleType

import torch
import torch.distributed as dist

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "reduce")


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes

    def take(self) -> int:
        """The bytes counted since the last call."""
        with self._lock:
            taken, self.total = self.total, 0
        return taken


COUNTER = _Counter()


class _CountingDist:
    """``torch.distributed`` with collectives that add their payload to :data:`COUNTER`."""

    def __getattr__(self, name: str):
        real = getattr(dist, name)
        if name not in _COLLECTIVES:
            return real

        def counted(tensor, *args, **kwargs):
            # all_gather(list, tensor): the payload is the second argument
            sent = args[0] if name == "all_gather" else tensor
            COUNTER.add(sent.numel() * sent.element_size() if isinstance(sent, torch.Tensor) else 0)
            return real(tensor, *args, **kwargs)

        return counted


PROXY = _CountingDist()


def install(*modules: ModuleType) -> None:
    """Route the collectives of ``modules`` (each uses ``dist`` for ``torch.distributed``) through the counter."""
    for module in modules:
        module.dist = PROXY
