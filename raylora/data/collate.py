"""Training batches from packs, with the attention mask that keeps packed examples apart.

Position ids alone do not isolate examples in transformers' sdpa or eager attention; a 4D additive
float mask, block-diagonal and causal, together with the restarting position ids, gives each
example exactly the logits it has alone. The examples' boundaries go along too, for attention that
computes each example on its own (:mod:`raylora.ops.packed_attention`).
"""

from __future__ import annotations

import torch

from raylora.data.encode import IGNORE_INDEX


def block_causal_mask(
    seq_lens: list[list[int]], width: int, dtype: torch.dtype = torch.float32, shared: list[list[int]] | None = None
) -> torch.Tensor:
    """Additive attention mask of shape (B, 1, width, width): 0 where a token may attend, dtype-min elsewhere.

    Token i attends to token j when both lie in the same example and j <= i, and, with ``shared`` (each example's
    count of leading tokens of the example before it that it reads: a preference pair's prompt), to those tokens
    too. Padding positions attend only to themselves, so no row is fully masked (which would give NaN).
    """
    segment = torch.full((len(seq_lens), width), -1, dtype=torch.long)
    offset = torch.zeros((len(seq_lens), width), dtype=torch.long)  # a token's place in its example
    reach = torch.zeros((len(seq_lens), width), dtype=torch.long)  # its example's shared count
    for row, lens in enumerate(seq_lens):
        start = 0
        for k, n in enumerate(lens):
            segment[row, start : start + n] = k
            offset[row, start : start + n] = torch.arange(n)
            reach[row, start : start + n] = shared[row][k] if shared else 0
            start += n
    same = segment[:, :, None] == segment[:, None, :]
    real = (segment[:, :, None] >= 0) & same
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (real & causal) | torch.eye(width, dtype=torch.bool)
    before = (segment[:, :, None] - 1 == segment[:, None, :]) & (segment[:, None, :] >= 0)
    allowed |= before & (offset[:, None, :] < reach[:, :, None])
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
    return torch.tensor([0, *(end for end, _ in _segments(seq_lens, width))], dtype=torch.int32)


def segment_shared(seq_lens: list[list[int]], shared: list[list[int]], width: int) -> torch.Tensor:
    """Each segment of :func:`segment_bounds`, its ``shared`` count (the leading tokens of the segment before it
    that it reads), int32; padding's are 0."""
    return torch.tensor([count for _, count in _segments(seq_lens, width, shared)], dtype=torch.int32)


def _segments(seq_lens: list[list[int]], width: int, shared: list[list[int]] | None = None):
    """Each segment's end over the flattened tokens, and its shared count (0 without ``shared``, and for padding)."""
    for row, lens in enumerate(seq_lens):
        end = row * width
        for k, n in enumerate(lens):
            end += n
            yield end, shared[row][k] if shared else 0
        while end < (row + 1) * width:
            end = min(end + PAD_SEGMENT, (row + 1) * width)
            yield end, 0


def collate_packs(
    rows: list[dict], pad_id: int, dtype: torch.dtype = torch.float32, width: int = 0
) -> dict[str, torch.Tensor]:
    """A training batch from pack rows: ``input_ids``, ``labels``, ``position_ids`` (B, T), ``attention_mask``
    (B, 1, T, T) and ``cu_seq_lens``, the examples' boundaries of :func:`segment_bounds`; for packs of preference
    pairs (a ``shared`` column), ``shared_prefix``, :func:`segment_shared`.

    T is the longest row, or ``width`` when that is longer (a fixed T keeps every row's numbers independent
    of the other rows of the batch).
    """
    width = max(width, *(len(r["input_ids"]) for r in rows))
    seq_lens = [list(r["seq_lens"]) for r in rows]
    shared = [list(r["shared"]) for r in rows] if "shared" in rows[0] else None

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.tensor([list(r[key]) + [value] * (width - len(r[key])) for r in rows])

    batch = {
        "input_ids": pad("input_ids", pad_id),
        "labels": pad("labels", IGNORE_INDEX),
        "position_ids": pad("position_ids", 0),
        "attention_mask": block_causal_mask(seq_lens, width, dtype, shared),
        "cu_seq_lens": segment_bounds(seq_lens, width),
    }
    if shared is not None:
        batch["shared_prefix"] = segment_shared(seq_lens, shared, width)
    return batch
