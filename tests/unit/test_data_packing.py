import torch

from raylora.data.collate import block_causal_mask, collate_packs
from raylora.data.encode import IGNORE_INDEX
from raylora.data.packing import join, pack_lengths
from raylora.models import tiny_model


def test_best_fit_decreasing_fills_bins_and_never_splits():
    lengths = [700, 300, 500, 200, 100, 1024, 40]
    bins = pack_lengths(lengths, 1024)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in bins)
    assert len(bins) == 3


def test_oversized_example_gets_its_own_bin():
    assert pack_lengths([50, 10], 20) == [[0], [1]]


def test_join_restarts_positions_and_masks_each_first_token():
    pack = join([([1, 2, 3], [1, 2, 3]), ([4, 5], [IGNORE_INDEX, 5])])
    assert pack == {
        "input_ids": [1, 2, 3, 4, 5],
        "labels": [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5],
        "position_ids": [0, 1, 2, 0, 1],
        "seq_lens": [3, 2],
    }


def test_mask_is_block_diagonal_and_causal():
    allowed = block_causal_mask([[2, 3]], 6)[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],  # padding attends only to itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


def test_packed_example_logits_and_loss_equal_the_example_alone():
    """Tolerance: 1e-5 absolute on fp32 logits of a 2-layer Llama (sdpa)."""
    model = tiny_model("llama").eval()
    g = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (7, 12, 5)]
    rows = [
        {**join([(e, e) for e in examples]), "num_tokens": 24},
        {**join([(examples[1], examples[1])]), "num_tokens": 12},
    ]
    batch = collate_packs(rows, pad_id=0)
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
        start = 0
        for e in examples:
            alone = model(input_ids=torch.tensor([e])).logits[0]
            torch.testing.assert_close(packed[0, start : start + len(e)], alone, atol=1e-5, rtol=0)
            start += len(e)
        # the padded second row holds example 1 alone: its logits match too
        torch.testing.assert_close(
            packed[1, :12], model(input_ids=torch.tensor([examples[1]])).logits[0], atol=1e-5, rtol=0
        )

        loss_packed = model(**{k: v[:1] for k, v in batch.items()}).loss
        per_example = [model(input_ids=torch.tensor([e]), labels=torch.tensor([e])).loss for e in examples]
        weights = torch.tensor([len(e) - 1 for e in examples], dtype=torch.float)
        torch.testing.assert_close(
            loss_packed, (torch.stack(per_example) * weights).sum() / weights.sum(), atol=1e-5, rtol=0
        )


def test_position_ids_alone_do_not_isolate_examples():
    """Why the 4D mask exists: with a plain padding mask, the second example sees the first."""
    model = tiny_model("llama").eval()
    a, b = [5, 6, 7, 8], [9, 10, 11]
    pack = join([(a, a), (b, b)])
    with torch.no_grad():
        leaky = model(
            input_ids=torch.tensor([pack["input_ids"]]), position_ids=torch.tensor([pack["position_ids"]])
        ).logits
        alone = model(input_ids=torch.tensor([b])).logits[0]
    assert not torch.allclose(leaky[0, 4:], alone, atol=1e-3)


def test_vectorised_pack_batch_matches_the_reference_join():
    import pyarrow as pa

    from raylora.data.transforms import pack_batch

    g = torch.Generator().manual_seed(3)
    examples = [
        torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (40,), generator=g)
    ]
    labels = [[IGNORE_INDEX] * (len(e) // 2) + e[len(e) // 2 :] for e in examples]
    splits = ["eval" if i % 5 == 0 else "train" for i in range(len(examples))]
    table = pa.table(
        {
            "input_ids": pa.array(examples, pa.list_(pa.int32())),
            "labels": pa.array(labels, pa.list_(pa.int32())),
            "split": splits,
            "origin": ["a"] * 20 + ["b"] * 20,
        }
    )
    for packing in (True, False):
        packs = pack_batch(table, 64, packing).to_pylist()
        assert sum(len(p["seq_lens"]) for p in packs) == len(examples)
        for pack in packs:
            members = []
            start = 0
            for n in pack["seq_lens"]:
                i = next(
                    i
                    for i, e in enumerate(examples)
                    if e == pack["input_ids"][start : start + n] and splits[i] == pack["split"]
                )
                members.append((examples[i], labels[i]))
                start += n
            assert {k: pack[k] for k in ("input_ids", "labels", "position_ids", "seq_lens")} == join(members)
            assert pack["num_tokens"] == len(pack["input_ids"]) <= 64 or len(pack["seq_lens"]) == 1
        if not packing:
            assert all(len(p["seq_lens"]) == 1 for p in packs)


def test_pack_batch_of_nothing_is_empty():
    import pyarrow as pa

    from raylora.data.transforms import pack_batch

    empty = pa.table(
        {
            "input_ids": pa.array([], pa.list_(pa.int32())),
            "labels": pa.array([], pa.list_(pa.int32())),
            "split": pa.array([], pa.string()),
            "origin": pa.array([], pa.string()),
        }
    )
    assert pack_batch(empty, 64, True).num_rows == 0
