import gc

import pytest

from raylora.data.transforms import gc_paused


def test_gc_is_paused_inside_and_restored_after_even_on_error():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's choice to keep it off is kept
    finally:
        gc.enable()


def test_shards_of_batches_that_open_alike_do_not_overwrite_each_other(tmp_path):
    import pyarrow as pa
    import pyarrow.dataset as pads

    from raylora.data.transforms import pack_batch, write_shard

    def batch(last: int, origin: str = "0") -> pa.Table:
        ids = [list(range(100)) + [last]]  # the same first 100 tokens, as rows behind one long system prompt
        examples = pa.table({"input_ids": ids, "labels": ids, "split": ["train"], "origin": [origin]})
        return pack_batch(examples, 128, True)

    for last in (1, 2):
        write_shard(batch(last), str(tmp_path))
    write_shard(batch(1), str(tmp_path))  # a retried task: the same file again
    rows = pads.dataset(str(tmp_path / "split=train"), format="parquet").to_table().to_pylist()
    assert sorted(r["input_ids"][-1] for r in rows) == [1, 2]
    assert "origin" not in rows[0]
    # Found by use: two copies of one file (a way to upsample it) wrote the same shards, and half the data was gone.
    write_shard(batch(1, origin="1"), str(tmp_path))
    rows = pads.dataset(str(tmp_path / "split=train"), format="parquet").to_table().to_pylist()
    assert sorted(r["input_ids"][-1] for r in rows) == [1, 1, 2]
