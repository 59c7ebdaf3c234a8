import pyarrow as pa
import pytest

from raylora.data.packs import PackShard, epoch_order


def table(n: int) -> pa.Table:
    return pa.table({"input_ids": [[i, i + 1] for i in range(n)], "num_tokens": list(range(n))})


def test_workers_read_interleaved_equal_shares_that_together_are_one_workers_rows():
    rows = table(11)
    shares = [PackShard(rows, rank, 2).epoch().column("num_tokens").to_pylist() for rank in range(2)]
    assert shares == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]  # row 10 left out: equal shares, as Ray's split
    assert PackShard(rows).epoch().column("num_tokens").to_pylist() == list(range(11))

    def batches(shard, size):
        return [b.column("num_tokens").to_pylist() for b in shard.iter_batches(batch_size=size, drop_last=True)]

    worker0, worker1 = (batches(PackShard(rows, rank, 2), 2) for rank in range(2))
    two_workers = [sorted(a + b) for a, b in zip(worker0, worker1, strict=True)]
    one_worker = [
        b.column("num_tokens").to_pylist() for b in PackShard(rows).iter_batches(batch_size=4, drop_last=True)
    ]
    assert two_workers == one_worker == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_batches_keep_order_and_drop_the_short_last_one_only_when_asked():
    shard = PackShard(table(5))
    assert [b.num_rows for b in shard.iter_batches(batch_size=2)] == [2, 2, 1]
    assert [b.num_rows for b in shard.iter_batches(batch_size=2, drop_last=True)] == [2, 2]
    assert next(shard.iter_batches(batch_size=2)).to_pylist() == table(2).to_pylist()
    with pytest.raises(ValueError, match="pyarrow tables only"):
        next(shard.iter_batches(batch_size=2, batch_format="numpy"))


def test_each_epoch_reads_every_pack_once_in_an_order_drawn_from_the_seed_whatever_the_worker_count():
    """Packs are written longest first; training reads each epoch in a seeded order of its own. Two workers with
    micro-batch 2 read together what one worker with micro-batch 4 reads, so a resumed run with another worker
    count continues the same order."""
    rows = table(40)

    def batches(shard, size, epoch, seed):
        return [b.column("num_tokens").to_pylist() for b in shard.iter_batches(batch_size=size, epoch=epoch, seed=seed)]

    one = {epoch: batches(PackShard(rows), 4, epoch, seed=7) for epoch in (0, 1)}
    for epoch in (0, 1):
        read = [n for batch in one[epoch] for n in batch]
        assert sorted(read) == list(range(40)) and read == epoch_order(40, 7, epoch)
        pair = [batches(PackShard(rows, rank, 2), 2, epoch, seed=7) for rank in range(2)]
        assert [sorted(a + b) for a, b in zip(*pair, strict=True)] == [sorted(b) for b in one[epoch]]
    assert one[0] != one[1] and one[0] != batches(PackShard(rows), 4, 0, seed=8)
    assert one[0] == batches(PackShard(rows), 4, 0, seed=7)
    assert one[0][0] != [0, 1, 2, 3]
    assert [n for b in batches(PackShard(rows), 4, 3, seed=None) for n in b] == list(range(40))


def test_batch_after_reads_what_the_epochs_batches_read_and_resumes_from_a_position_with_another_worker_count():
    """A position is (epoch, rows read by all workers): the lone worker and a group member read on from it alike."""
    rows = table(10)

    def walk(shard, size, steps, position=(0, 0)):
        read = []
        for _ in range(steps):
            batch, position = shard.batch_after(position, size, seed=3)
            read.append([r["num_tokens"] for r in batch])
        return read, position

    one, end = walk(PackShard(rows), 4, 4)
    epochs = [[b.column("num_tokens").to_pylist() for b in PackShard(rows).iter_batches(batch_size=4, drop_last=True,
              epoch=e, seed=3)] for e in (0, 1)]  # fmt: skip
    assert one == epochs[0] + epochs[1] and end == (1, 8)  # the epoch's last 2 rows fill no batch
    first, position = walk(PackShard(rows), 4, 1)
    pair = [walk(PackShard(rows, rank, 2), 2, 1, position)[0][0] for rank in range(2)]
    assert sorted(pair[0] + pair[1]) == sorted(one[1])  # two workers read on where one stopped
    with pytest.raises(RuntimeError, match="fewer than train.batch_size=11"):
        PackShard(rows).batch_after((0, 0), 11, seed=3)
