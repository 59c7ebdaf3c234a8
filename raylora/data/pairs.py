"""Preference pairs to token ids: both answers after the same prompt tokens, each pair cut to fit one pack.

A pair is encoded as two conversations, prompt + chosen answer and prompt + rejected answer, by the
:class:`~raylora.data.encode.Encoder` exactly as supervised rows are: the template rendered prefix by prefix, the
answers' assistant turns learned with their end-of-turn tokens, the prompt not. The tokens before each answer's
first learned label must then be the same; a pair whose prompt renders differently (a template that prints the
date, rendered either side of midnight) is rejected. Both conversations go into one pack, so a pair holds at most
``cutoff_len`` tokens with its prompt counted twice: ``truncation: reject`` rejects a longer pair; ``tail`` cuts the
answers' ends, the longer one first, until the pair fits, the prompt whole and the same in both.
"""

from __future__ import annotations

import numpy as np

from raylora.data.encode import IGNORE_INDEX, EncodedBatch, Encoder
from raylora.data.formats import RowError
from raylora.data.preference import Pair, conversations

PROMPT_DIFFERS = "the prompt renders differently before the chosen and the rejected answer"


def encode_pairs(encoder: Encoder, pairs: list[Pair]) -> tuple[EncodedBatch, np.ndarray]:
    """Encode a batch of pairs with ``encoder`` (its ``cutoff_len`` and ``truncation`` apply to each pair).

    Returns:
        The batch, whose row ``i`` is pair ``i``'s chosen conversation followed by its rejected one (a rejected pair
        has no tokens and its :class:`~raylora.data.formats.RowError`), and the two conversations' lengths, shape
        ``(len(pairs), 2)``, int64.
    """
    batch = encoder.encode_arrays([c for pair in pairs for c in conversations(pair)], whole=True)
    keep = np.zeros((len(pairs), 2), np.int64)
    errors: list[RowError | None] = []
    for i in range(len(pairs)):
        fitted = _fit(batch, i, encoder.cutoff_len, encoder.truncation)
        if isinstance(fitted, RowError):
            errors.append(fitted)
        else:
            errors.append(None)
            keep[i] = fitted
    lens = np.diff(batch.offsets)
    position = np.arange(len(batch.input_ids)) - np.repeat(batch.offsets[:-1], lens)
    kept = position < np.repeat(keep.ravel(), lens)
    offsets = np.concatenate([[0], np.cumsum(keep.sum(axis=1))])
    return EncodedBatch(batch.input_ids[kept], batch.labels[kept], offsets, errors), keep


def _fit(batch: EncodedBatch, i: int, cutoff: int, truncation: str) -> tuple[int, int] | RowError:
    """How many tokens of pair ``i``'s chosen and rejected conversations it keeps, or why it is rejected."""
    for j, which in ((2 * i, "chosen"), (2 * i + 1, "rejected")):
        if batch.errors[j] is not None:
            return RowError(f"{which}: {batch.errors[j]}")
    (a, b), (c, d) = batch.offsets[2 * i : 2 * i + 2], batch.offsets[2 * i + 1 : 2 * i + 3]
    ids = batch.input_ids
    prompt = int(np.argmax(batch.labels[a:b] != IGNORE_INDEX))  # the encoder rejects a row with nothing learned
    if prompt != np.argmax(batch.labels[c:d] != IGNORE_INDEX) or not np.array_equal(
        ids[a : a + prompt], ids[c : c + prompt]
    ):
        return RowError(PROMPT_DIFFERS)
    chosen, rejected = int(b - a) - prompt, int(d - c) - prompt
    total = 2 * prompt + chosen + rejected
    if total <= cutoff:
        return prompt + chosen, prompt + rejected
    if truncation == "reject":
        # the count after ";": the summary groups reasons by what comes before it
        return RowError(f"the pair is longer than data.cutoff_len={cutoff}; {total} tokens, the prompt counted twice")
    room = cutoff - 2 * prompt
    if room < 2:
        return RowError(
            f"the prompt, twice, leaves no room for the answers in data.cutoff_len={cutoff}; {prompt} tokens"
        )
    shorter = min(chosen, rejected)
    cap = room - shorter if 2 * shorter <= room else room // 2  # the shorter answer whole if the longer keeps as much
    chosen, rejected = min(chosen, cap), min(rejected, cap)
    if chosen == rejected and np.array_equal(
        ids[a + prompt : a + prompt + chosen], ids[c + prompt : c + prompt + chosen]
    ):
        return RowError(f"the chosen and rejected answers are the same once cut to data.cutoff_len={cutoff}")
    return prompt + chosen, prompt + rejected
