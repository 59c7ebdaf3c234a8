"""Training batches from packs, with the attention mask that keeps packed examples apart.

Position ids alone do not isolate examples in transformers' sdpa or eager attention; a 4D additive
float mask, block-diagonal and causal, together with the restarting position ids, gives each
example exactly the logits it has alone. The examples' boundaries go along too, for attention that
computes each example on its own (:mod:`raylora.ops.packed_attention`).
"""

from __future__ import annotations

import torch

from raylora.data.encode import IGNORE_INDEX


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


PAD_SEGMENT = 64  # longest segment of a row's padding


def segment_bounds(seq_lens: list[list[int]], width: int) -> torch.Tensor:
    """Boundaries of the examples over the flattened ``(len(seq_lens) * width)`` tokens, int32, starting at 0:
    each row's examples in order, then its padding (if any) in segments of at most :data:`PAD_SEGMENT` tokens.
    Nothing reads what padding computes, so how it is cut changes no number; one long padding segment (a row
    padded to a ``data.cutoff_len`` over 512, as a grouped sweep pads) would send the whole batch to the
    per-example path of :mod:`raylora.ops.packed_attention`, which takes a batch in one call only when no segment
    is longer than 512 tokens."""
    bounds = [0]
    for row, lens in enumerate(seq_lens):
        end = row * width
        for n in lens:
            end += n
            bounds.append(end)
        while end < (row + 1) * width:
            end = min(end + PAD_SEGMENT, (row + 1) * width)
            bounds.append(end)
    return torch.tensor(bounds, dtype=torch.int32)


def collate_packs(
    rows: list[dict], pad_id: int, dtype: torch.dtype = torch.float32, width: int = 0
) -> dict[str, torch.Tensor]:
    """A training batch from pack rows: ``input_ids``, ``labels``, ``position_ids`` (B, T), ``attention_mask``
    (B, 1, T, T) and ``cu_seq_lens``, the examples' boundaries of :func:`segment_bounds`.

    T is the longest row, or ``width`` when that is longer (a fixed T keeps every row's numbers independent
    of the other rows of the batch).
    """
    width = max(width, *(len(r["input_ids"]) for r in rows))
    seq_lens = [list(r["seq_lens"]) for r in rows]

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.tensor([list(r[key]) + [value] * (width - len(r[key])) for r in rows])

    return {
        "input_ids": pad("input_ids", pad_id),
        "labels": pad("labels", IGNORE_INDEX),
        "position_ids": pad("position_ids", 0),
        "attention_mask": block_causal_mask(seq_lens, width, dtype),
        "cu_seq_lens": segment_bounds(seq_lens, width),
    }
