"""The generation engine's attention: a sequence's result does not depend on the batch it runs in.

With sdpa, a sequence's keys and values padded to another width, or its prompt prefilled beside others, changed the
last bits of its attention output (sdpa's CPU kernel splits the keys by the batch's width: one decode row among
others differed from the same row alone in 151 of 160 random cases on 2 cores), and a W8A8 model turns such bits
into other int8 activations, so a greedy answer could differ between `raylora eval` (64 rows) and `raylora serve`
(its own batch). Here:

- a decode step (one query per row) computes scores, softmax and the weighted values with plain matmuls over keys
  padded to whole blocks of :data:`BLOCK` columns (the engine's cache hands them so, :mod:`raylora.kv_slots`):
  a row's sums then run over the same columns in the same order whatever the batch (none of 320 such cases differ;
  unpadded, a quarter did);
- a prefill computes each prompt on its own: its queries over its own keys (``prefill_rows``), shaped exactly as if
  it were alone.

The int8 linears are exact and per token; the LoRA op accumulates in float64 (:mod:`raylora.ops.lora`). So a greedy
answer is the same alone or in any batch, for prompts prefilled whole (not cut into chunks of
``max_prefill_tokens``, not started from the prefix cache) on the same number of threads
(``tests/unit/test_engine_attention.py``).

The function is registered with transformers' ``AttentionInterface`` under :data:`NAME`; the engine selects it for
its own forward passes only (:func:`selected`), so a model that trains between generations keeps its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "raylora_engine"
# Keys are attended in whole blocks of this many columns: padded to whole blocks of 8 or more, a row's result no longer
# depended on the batch's width on this machine's 16-float vectors (4: 8 of 320 cases differed); 16, one AVX-512
# vector, for margin.
BLOCK = 16


def _ceil(n: int, step: int) -> int:
    return -(-n // step) * step


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention with grouped key heads, keys padded to whole blocks of :data:`BLOCK`.

    Args:
        query: (B, H, Q, D); key, value: (B, H_kv, L, D); mask: bool (B, 1, Q, L), True where a query may look.
    Returns:
        (B, H, Q, D).
    """
    b, h, q, d = query.shape
    kv = key.shape[1]
    width = key.shape[2]
    if width % BLOCK:
        extra = _ceil(width, BLOCK) - width
        key = torch.nn.functional.pad(key, (0, 0, 0, extra))
        value = torch.nn.functional.pad(value, (0, 0, 0, extra))
        mask = torch.nn.functional.pad(mask, (0, extra), value=False)
        width += extra
    group = h // kv
    scores = torch.matmul(query.reshape(b, kv, group * q, d), key.transpose(-1, -2)).mul_(scale)
    scores = scores.view(b, kv, group, q, width).masked_fill_(~mask[:, :, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).view(b, kv, group * q, width)
    return torch.matmul(probs, value).view(b, h, q, d)


def causal(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """(1, 1, queries, keys) bool: the queries are the last ``queries`` positions of ``keys``."""
    positions = torch.arange(keys - queries, keys, device=device)
    return (torch.arange(keys, device=device)[None, :] <= positions[:, None])[None, None]


def engine_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    prefill_rows: list[tuple[int, int]] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, Q, D), key and value (B, H_kv, L, D); returns (B, Q, H, D).

    ``prefill_rows`` (a prefill): per row, ``(keys, queries)``: its keys are the last ``keys`` columns and its
    queries the last ``queries`` of the batch's; each row is computed alone, causally, and its padding queries give
    zeros. Without it the mask is read (None: causal).
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if prefill_rows is None:
        mask = attention_mask if attention_mask is not None else causal(query.shape[2], key.shape[2], query.device)
        out = attend(query, key, value, mask.bool(), scale)
    else:
        out = query.new_zeros(query.shape)
        width, count = key.shape[2], query.shape[2]
        for i, (keys, queries) in enumerate(prefill_rows):
            out[i : i + 1, :, count - queries :] = attend(
                query[i : i + 1, :, count - queries :], key[i : i + 1, :, width - keys :],
                value[i : i + 1, :, width - keys :], causal(queries, keys, query.device), scale,
            )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, engine_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def selected(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s attention through :func:`engine_attention` within the block (its own choice again after)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
