"""Prepared packs handed to training workers through Ray's object store; each worker reads its own rows.

A Ray Dataset given to Ray Train costs every run a split coordinator actor (a fresh process importing
Ray Data, a few seconds of start-up that every trial of a sweep pays) and a streaming execution per epoch. Prepared
shards are already packed token ids, small enough to hold in memory, so a worker needs only its rows:
:class:`Packs` holds one object-store table per shard file, and :func:`worker_share` gives a worker its
equal share of them. A streamed job (``data.streaming``) still hands Ray Train a Ray Dataset.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from raylora.cluster import ensure_ray


class Packs(NamedTuple):
    """The packs of one split in Ray's object store.

    Attributes:
        tables: ``ObjectRef[pyarrow.Table]``, one per shard file, in file order.
        rows: packs in all tables.
    """

    tables: list[Any]
    rows: int


def put_packs(folder: str | Path) -> Packs:
    """The shard files (``*.parquet``) of ``folder``, read on the driver and put in Ray's object store in name order."""
    ensure_ray()
    tables = [pq.read_table(path) for path in sorted(Path(folder).glob("*.parquet"))]
    return Packs([ray.put(t) for t in tables], sum(t.num_rows for t in tables))


def read_packs(packs: Packs):
    """All packs as one ``pyarrow.Table`` (zero-copy from the object store on the same node)."""
    return pa.concat_tables(ray.get(packs.tables))


def worker_share(packs: Packs, rank: int = 0, world: int = 1) -> PackShard:
    """Worker ``rank`` of ``world``'s :class:`PackShard` of ``packs``."""
    return PackShard(read_packs(packs), rank, world)


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch ``epoch`` reads ``count`` packs: a permutation drawn from ``(seed, epoch)`` alone.

    Packing writes each shard longest examples first (best-fit decreasing), so read as stored a run would
    train on its longest examples first and its shortest last. Each pack's place comes from a hash of
    ``(seed, epoch, pack)``, so the order stays the same across Python and library versions (a resumed run
    reads on in it).
    """
    key = f"{seed}/{epoch}/".encode()
    return sorted(range(count), key=lambda i: hashlib.blake2b(key + str(i).encode(), digest_size=8).digest())


class PackShard:
    """Worker ``rank`` of ``world``'s rows of ``table`` (all the packs), epoch by epoch.

    With a seed, epoch ``e`` reads all packs in the order :func:`epoch_order` draws from ``(seed, e)``, and the
    worker takes every ``world``-th of them from ``rank`` on: every worker draws the same order, so the workers
    together read each pack once an epoch, ``world`` workers with micro-batch ``b`` read together what one worker
    with micro-batch ``world·b`` reads, and a resumed run reads on in the same order whatever its worker count.
    The ``num_rows % world`` last packs of the order are left out, the same count for every rank, as Ray's equal
    split does. Without a seed
    (evaluation), the packs are read as stored. ``iter_batches`` is the subset of Ray's
    ``DataIterator.iter_batches`` that training uses, so a Ray Train dataset shard (a streamed job's, read in the
    stream's order) stands in for it.
    """

    def __init__(self, table, rank: int = 0, world: int = 1):
        self.table, self.rank, self.world = table, rank, world
        self._indices = functools.lru_cache(maxsize=16)(self.indices)  # a group's members read several epochs

    @property
    def num_rows(self) -> int:
        """Rows this worker reads an epoch."""
        return self.table.num_rows // self.world

    def epoch(self, epoch: int = 0, seed: int | None = None):
        """This worker's rows of epoch ``epoch`` (a ``pyarrow.Table``), in the order it reads them."""
        return self.table.take(pa.array(self.indices(epoch, seed), pa.int64()))

    def indices(self, epoch: int = 0, seed: int | None = None) -> list[int]:
        """Which rows of the table this worker reads in epoch ``epoch``, in order: every ``world``-th of the epoch's
        order from ``rank`` on."""
        count = self.table.num_rows
        order = range(count) if seed is None else epoch_order(count, seed, epoch)
        return list(order[self.rank : self.num_rows * self.world : self.world])

    def batch_after(self, position: tuple[int, int], size: int, seed: int) -> tuple[list[dict], tuple[int, int]]:
        """The next micro-batch of ``size`` rows after ``position`` in the epochs ``seed`` orders, and its end.

        A position is ``(epoch, rows read in it by all workers)``, what a checkpoint records: a run resumed with
        another worker count reads on from the same place. An epoch's last rows that fill no micro-batch are
        left out.
        Raises:
            RuntimeError: this worker's share holds fewer than ``size`` rows.
        """
        if self.num_rows < size:
            raise RuntimeError(f"this worker's data shard holds fewer than train.batch_size={size} sequences")
        epoch, start = position[0], position[1] // self.world
        if start + size > self.num_rows:
            epoch, start = epoch + 1, 0
        rows = self._indices(epoch, seed)[start : start + size]
        return self.table.take(pa.array(rows, pa.int64())).to_pylist(), (epoch, (start + size) * self.world)

    def iter_batches(
        self,
        *,
        batch_size: int,
        batch_format: str = "pyarrow",
        drop_last: bool = False,
        epoch: int = 0,
        seed: int | None = None,
    ) -> Iterator:
        """``pyarrow.Table`` batches of ``batch_size`` rows of :meth:`epoch`; the last, shorter one only without
        ``drop_last``."""
        if batch_format != "pyarrow":
            raise ValueError(f"PackShard yields pyarrow tables only, not {batch_format!r}")
        rows = self.epoch(epoch, seed)
        end = rows.num_rows - (rows.num_rows % batch_size if drop_last else 0)
        for start in range(0, end, batch_size):
            yield rows.slice(start, batch_size)
