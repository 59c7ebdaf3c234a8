"""Training batches from packs, with the attention mask that keeps packed examples apart.

Position ids alone do not isolate examples in transformers' sdpa or eager attention; a 4D additive
float mask, block-diagonal and causal, together with the restarting position ids, gives each
example exactly the logits it has alone.
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


def collate_packs(
    rows: list[dict], pad_id: int, dtype: torch.dtype = torch.float32, width: int = 0
) -> dict[str, torch.Tensor]:
    """A training batch from pack rows: ``input_ids``, ``labels``, ``position_ids`` (B, T) and ``attention_mask`` (B, 1, T, T).

    T is the longest row, or ``width`` when that is longer (a fixed T keeps every row's numbers independent
    of the other rows of the batch).
    """
    width = max(width, *(len(r["input_ids"]) for r in rows))

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.tensor([list(r[key]) + [value] * (width - len(r[key])) for r in rows])

    return {
        "input_ids": pad("input_ids", pad_id),
        "labels": pad("labels", IGNORE_INDEX),
        "position_ids": pad("position_ids", 0),
        "attention_mask": block_causal_mask([list(r["seq_lens"]) for r in rows], width, dtype),
    }
