"""Preference pairs to token ids: the prompt once, then each answer after it, each pair cut to fit one pack.

A pair is encoded as two conversations, prompt + chosen answer and prompt + rejected answer, by the
:class:`~raylora.data.encode.Encoder` exactly as supervised rows are: the template rendered prefix by prefix, the
answers' assistant turns learned with their end-of-turn tokens, the prompt not. The tokens before each answer's
first learned label must then be the same; a pair whose prompt renders differently (a template that prints the
date, rendered either side of midnight) is rejected.

The prompt is computed once (prefix sharing): a pair is two sequences, the prompt with the chosen answer, then the
prompt's last token with the rejected answer, which attends to the rest of the prompt in the sequence before it
(its ``shared`` count, :mod:`raylora.data.collate` and :mod:`raylora.ops.packed_attention`) and takes the
positions that follow it. Each answer's log-probabilities are those it has after the whole prompt alone, and the
first sequence's shift is the usual one. A pair so holds ``prompt + 1 + chosen + rejected`` tokens, at most
``cutoff_len``: ``truncation: reject`` rejects a longer pair; ``tail`` cuts the answers' ends, the longer one first,
until the pair fits, the prompt whole.
"""

from __future__ import annotations

import numpy as np

from raylora.data.encode import IGNORE_INDEX, EncodedBatch, Encoder
from raylora.data.formats import RowError
from raylora.data.preference import Pair, conversations

PROMPT_DIFFERS = "the prompt renders differently before the chosen and the rejected answer"


def encode_pairs(encoder: Encoder, pairs: list[Pair]) -> tuple[EncodedBatch, np.ndarray, np.ndarray]:
    """Encode a batch of pairs with ``encoder`` (its ``cutoff_len`` and ``truncation`` apply to each pair).

    Returns:
        The batch, whose row ``i`` is pair ``i``'s first sequence (prompt and chosen answer) followed by its second
        (the prompt's last token and the rejected answer; a rejected pair has no tokens and its
        :class:`~raylora.data.formats.RowError`); the two sequences' lengths, shape ``(len(pairs), 2)``; and their
        ``shared`` counts, the same shape: 0, and the prompt tokens the second one reads from the first. Both int64.
    """
    batch = encoder.encode_arrays([c for pair in pairs for c in conversations(pair)], whole=True)
    spans = np.zeros((len(pairs), 2, 2), np.int64)  # the [start, end) kept of each conversation
    errors: list[RowError | None] = []
    for i in range(len(pairs)):
        fitted = _fit(batch, i, encoder.cutoff_len, encoder.truncation)
        if isinstance(fitted, RowError):
            errors.append(fitted)
            continue
        errors.append(None)
        prompt, chosen, rejected = fitted
        spans[i] = ((0, prompt + chosen), (prompt - 1, prompt + rejected))
    lens = np.diff(batch.offsets)
    position = np.arange(len(batch.input_ids)) - np.repeat(batch.offsets[:-1], lens)
    starts, ends = spans[..., 0].ravel(), spans[..., 1].ravel()
    kept = (position >= np.repeat(starts, lens)) & (position < np.repeat(ends, lens))
    seq_lens = spans[..., 1] - spans[..., 0]
    shared = np.stack([np.zeros(len(pairs), np.int64), spans[:, 1, 0]], axis=1)
    offsets = np.concatenate([[0], np.cumsum(seq_lens.sum(axis=1))])
    return EncodedBatch(batch.input_ids[kept], batch.labels[kept], offsets, errors), seq_lens, shared


def _fit(batch: EncodedBatch, i: int, cutoff: int, truncation: str) -> tuple[int, int, int] | RowError:
    """Pair ``i``'s prompt tokens and how many tokens of its chosen and rejected answers it keeps, or why it is
    rejected."""
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
    if prompt == 0:
        return RowError("the answers begin at the first token: the template renders no prompt before them")
    chosen, rejected = int(b - a) - prompt, int(d - c) - prompt
    total = prompt + 1 + chosen + rejected
    if total <= cutoff:
        return prompt, chosen, rejected
    if truncation == "reject":
        # the count after ";": the summary groups reasons by what comes before it
        return RowError(f"the pair is longer than data.cutoff_len={cutoff}; {total} tokens, the prompt counted once")
    room = cutoff - prompt - 1
    if room < 2:
        return RowError(f"the prompt leaves no room for the answers in data.cutoff_len={cutoff}; {prompt} tokens")
    shorter = min(chosen, rejected)
    cap = room - shorter if 2 * shorter <= room else room // 2  # the shorter answer whole if the longer keeps as much
    chosen, rejected = min(chosen, cap), min(rejected, cap)
    if chosen == rejected and np.array_equal(
        ids[a + prompt : a + prompt + chosen], ids[c + prompt : c + prompt + chosen]
    ):
        return RowError(f"the chosen and rejected answers are the same once cut to data.cutoff_len={cutoff}")
    return prompt, chosen, rejected
