"""Packing several examples into one sequence.

Within a pack, position ids restart at 0 for every example (the attention mask that keeps examples
apart is built at batch time, ``raylora.data.collate``). The first token of each example is never
a target, exactly as when the example stands alone, so a packed example's loss equals its loss alone.
"""

from __future__ import annotations

import bisect

from raylora.data.encode import IGNORE_INDEX


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: group example indices into bins whose lengths sum to at most ``capacity``.

    An example longer than ``capacity`` gets a bin of its own (callers truncate or reject first).
    Returns:
        Bins of indices into ``lengths``, each in the order added.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    free: list[tuple[int, int]] = []  # (remaining capacity, bin id), kept sorted
    bins: list[list[int]] = []
    for i in order:
        pos = bisect.bisect_left(free, (lengths[i], -1))
        if pos < len(free):
            remaining, b = free.pop(pos)
        else:
            remaining, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        remaining -= lengths[i]
        if remaining > 0:
            bisect.insort(free, (remaining, b))
    return bins


def join(examples: list[tuple[list[int], list[int]]], shared: list[int] | None = None) -> dict[str, list[int]]:
    """One pack from ``[(input_ids, labels), ...]``: concatenated ids and labels, restarting position ids, lengths;
    with ``shared`` (each example's count of leading tokens of the example before it that it reads: pairs), its
    position ids start after them, and the pack carries ``shared``.

    The plain-Python reference of the vectorised ``raylora.data.transforms.pack_batch``.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    for k, (ids, labs) in enumerate(examples):
        input_ids += ids
        labels += [IGNORE_INDEX] + list(labs[1:])
        start = shared[k] if shared else 0
        position_ids += range(start, start + len(ids))
    pack = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "seq_lens": [len(i) for i, _ in examples],
    }
    return pack | ({"shared": list(shared)} if shared is not None else {})
