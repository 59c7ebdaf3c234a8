"""Packing several examples into one sequence, and the masks that keep them apart.

Within a pack, position ids restart at 0 for every example and the attention mask is
block-diagonal and causal (a 4D additive float mask; position ids alone do not isolate examples
in transformers' sdpa or eager attention). The first token of each example is never a target,
exactly as when the example stands alone, so a packed example's loss equals its loss alone.
"""

from __future__ import annotations

import bisect

import torch

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


def join(examples: list[tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    """One pack from ``[(input_ids, labels), ...]``: concatenated ids and labels, restarting position ids, lengths."""
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    for ids, labs in examples:
        input_ids += ids
        labels += [IGNORE_INDEX] + list(labs[1:])
        position_ids += range(len(ids))
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "seq_lens": [len(i) for i, _ in examples],
    }


def block_causal_mask(seq_lens: list[list[int]], width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive attention mask of shape (B, 1, width, width): 0 where a token may attend, dtype-min elsewhere.

    Token i attends to token j when both lie in the same example and j <= i. Padding positions
    attend only to themselves, so no row is fully masked (which would give NaN).
    """
    segment = torch.full((len(seq_lens), width), -1, dtype=torch.long)
    for row, lens in enumerate(seq_lens):
        start = 0
        for k, n in enumerate(lens):
            segment[row, start : start + n] = k
            start += n
    same = segment[:, :, None] == segment[:, None, :]
    real = (segment[:, :, None] >= 0) & same
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (real & causal) | torch.eye(width, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def collate_packs(rows: list[dict], pad_id: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A training batch from pack rows: ``input_ids``, ``labels``, ``position_ids`` (B, T) and ``attention_mask`` (B, 1, T, T)."""
    width = max(len(r["input_ids"]) for r in rows)

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.tensor([list(r[key]) + [value] * (width - len(r[key])) for r in rows])

    return {
        "input_ids": pad("input_ids", pad_id),
        "labels": pad("labels", IGNORE_INDEX),
        "position_ids": pad("position_ids", 0),
        "attention_mask": block_causal_mask([list(r["seq_lens"]) for r in rows], width, dtype),
    }
