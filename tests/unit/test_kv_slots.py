"""The engine's preallocated cache: rows join, leave (the last row moves in), grow and shrink without losing a value."""

import torch

from raylora import kv_slots
from raylora.kv_slots import Slots
from raylora.ops.engine_attention import BLOCK

LAYERS, HEADS, DIM = 2, 3, 4


def _prefill(lengths: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (batch, heads, width, dim) keys and values of a left-padded prefill of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    shape = (len(lengths), HEADS, width, DIM)
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)], [
        torch.randn(shape, generator=g) for _ in range(LAYERS)
    ]


def _row(slots: Slots, row: int) -> list[torch.Tensor]:
    n = slots.lengths[row]
    return [t[row, :, :n] for t in slots.keys + slots.values]


def test_rows_join_step_and_leave_with_each_row_keeping_its_own_values():
    slots = Slots()
    keys, values = _prefill([5, 2, 7], seed=0)
    expected = []
    for i, n in enumerate([5, 2, 7]):
        slots.add(keys, values, i, 7 - n, n)  # left-padded: row i's prompt is in its last n columns
        expected.append([t[i, :, 7 - n :] for t in keys + values])
    assert slots.lengths == [5, 2, 7]
    for row in range(3):
        for got, want in zip(_row(slots, row), expected[row], strict=True):
            assert torch.equal(got, want)

    mask, positions = slots.step()
    assert positions[:, 0].tolist() == [5, 2, 7]
    assert mask.shape == (3, 1, 1, BLOCK)  # a whole block of columns, as the engine's attention reads them
    assert mask[:, 0, 0].sum(1).tolist() == [6, 3, 8]  # its own tokens and the one it writes now
    new = [torch.full((3, HEADS, 1, DIM), float(layer + 1)) for layer in range(LAYERS)]
    for layer in range(LAYERS):
        k, v = slots.update(new[layer], -new[layer], layer)
        assert k.shape == (3, HEADS, BLOCK, DIM)
        assert torch.equal(k[1, :, 2], new[layer][1, :, 0]) and torch.equal(v[2, :, 7], -new[layer][2, :, 0])
    slots.stepped()
    assert slots.lengths == [6, 3, 8]
    for row in range(3):
        expected[row] = [torch.cat([e, (1 if k < LAYERS else -1) * new[k % LAYERS][row]], dim=1)
                         for k, e in enumerate(expected[row])]  # fmt: skip

    slots.remove(0)  # the last row (length 8) moves into row 0
    assert slots.lengths == [8, 3]
    for got, want in zip(_row(slots, 0), expected[2], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(_row(slots, 1), expected[1], strict=True):
        assert torch.equal(got, want)
    slots.remove(1)
    assert slots.lengths == [8]


def test_growing_past_a_block_and_shrinking_back_keep_every_value(monkeypatch):
    monkeypatch.setattr(kv_slots, "COLUMNS", 4)
    slots = Slots()
    keys, values = _prefill([3, 3], seed=1)
    slots.add(keys, values, 0, 0, 3)
    slots.add(keys, values, 1, 0, 3)
    steps = 4 * BLOCK + 8  # columns grow in steps of 4 as the rows reach 3 + steps tokens
    for _ in range(steps):
        slots.step()
        for layer in range(LAYERS):
            slots.update(torch.ones(2, HEADS, 1, DIM), torch.ones(2, HEADS, 1, DIM), layer)
        slots.stepped()
    assert slots.keys[0].shape[2] >= 3 + steps
    assert torch.equal(slots.keys[1][0, :, :3], keys[1][0]) and torch.equal(slots.values[0][1, :, :3], values[0][1])
    assert torch.equal(slots.keys[0][1, :, 3 : 3 + steps], torch.ones(HEADS, steps, DIM))
    short, _ = _prefill([2], seed=2)
    slots.add(short, short, 0, 0, 2)
    slots.remove(0)  # the short row moves into row 0
    slots.remove(1)  # left: the short row only, far below the columns held
    slots.step()
    assert slots.lengths == [2] and slots.keys[0].shape[2] <= 2 * BLOCK  # shrunk to twice the block it reads
    assert torch.equal(slots.keys[1][0, :, :2], short[1][0])


def test_rows_reserved_together_are_added_without_reallocating():
    slots = Slots()
    keys, values = _prefill([5] * 20, seed=3)
    slots.reserve(20, 6, keys[0], LAYERS)
    held = slots.keys[0]
    for row in range(20):
        slots.add(keys, values, row, 0, 5)
    assert slots.keys[0] is held and held.shape[0] >= 20
    assert all(torch.equal(slots.keys[1][row, :, :5], keys[1][row]) for row in range(20))
