"""The running batch's keys and values in the generation engine: one preallocated row per sequence, written in place.

Row ``i`` holds sequence ``i``'s keys and values in columns ``[0, lengths[i])`` of each layer's (rows, kv heads,
columns, head dim) tensors. A decode step writes each row's new token at that row's own column, where a transformers
``DynamicCache`` concatenates one column onto the whole cache every step (a copy of every key and value per layer
per token: 6.8% of a 64-row mixed-adapter decode of SmolLM2 W8A8 on 2 cores, more as answers grow). A sequence that
joins copies its prefilled keys and values into the next free row; one that leaves is replaced by the last row, so
the rows stay 0..n-1 and the batch is one forward. Tensors grow by whole blocks of rows and columns and shrink when the
longest sequence left is far shorter than them. The model reads it as a cache (``update``), with the 4-D mask that
:meth:`Slots.step` returns: each row sees its own columns only.
"""

from __future__ import annotations

import torch

from raylora.ops.engine_attention import BLOCK

ROWS, COLUMNS = 8, 64  # growth steps


def _ceil(n: int, step: int) -> int:
    return -(-n // step) * step


class Slots:
    """Keys and values of a batch of sequences of different lengths (see module docs)."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self._rows: torch.Tensor | None = None  # 0 .. rows - 1, on the cache's device
        self._at: torch.Tensor | None = None  # the column each row writes in the step in flight
        self._width = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], row: int, start: int, count: int) -> None:
        """Append a sequence: columns ``start .. start + count`` of row ``row`` of per-layer (batch, kv heads, columns,
        head dim) ``keys`` and ``values`` (a prefill's cache)."""
        n = len(self.lengths)
        self.reserve(n + 1, count + 1, keys[0], len(keys))
        for own, theirs in zip(self.keys + self.values, keys + values, strict=True):
            own[n, :, :count] = theirs[row, :, start : start + count]
        self.lengths.append(count)

    def remove(self, row: int) -> None:
        """Drop row ``row``; the last row takes its place."""
        last = len(self.lengths) - 1
        if row != last:
            length = self.lengths[last]
            for t in self.keys + self.values:
                t[row, :, :length] = t[last, :, :length]
            self.lengths[row] = length
        self.lengths.pop()

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a decode step of every row: returns its attention mask (rows, 1, 1, columns), True where a row's
        own tokens (and the one it writes now) are, and each row's position (rows, 1); the columns are whole blocks of
        :data:`~raylora.ops.engine_attention.BLOCK`."""
        at = torch.tensor(self.lengths)
        self._width = _ceil(max(self.lengths) + 1, BLOCK)  # whole blocks: the engine's attention reads them so
        self.reserve(len(self.lengths), self._width, self.keys[0], len(self.keys))
        have_rows, have_columns = self._shape()
        if have_columns >= 4 * self._width + COLUMNS:  # far longer than the longest row left: shrink
            self._resize(have_rows, _ceil(2 * self._width, COLUMNS), self.keys[0], len(self.keys))
        device = self.keys[0].device
        self._rows, self._at = torch.arange(len(self.lengths), device=device), at.to(device)  # every layer writes there
        mask = torch.arange(self._width)[None, :] <= at[:, None]
        return mask[:, None, None, :].to(device), at[:, None]

    def stepped(self) -> None:
        """The decode step is done: every row holds one token more."""
        self.lengths = [n + 1 for n in self.lengths]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args, **kwargs):
        """What an attention layer calls: write the step's (rows, kv heads, 1, head dim) keys and values at each row's
        column; returns every row's keys and values so far (views, no copy)."""
        n = keys.shape[0]
        self.keys[layer][self._rows, :, self._at] = keys[:, :, 0]
        self.values[layer][self._rows, :, self._at] = values[:, :, 0]
        return self.keys[layer][:n, :, : self._width], self.values[layer][:n, :, : self._width]

    def reserve(self, rows: int, columns: int, like: torch.Tensor, layers: int) -> None:
        """Make room for ``rows`` rows of ``columns`` columns in ``layers`` layers shaped and typed like ``like``, growing
        to whole blocks (a spare block of columns). The engine reserves for the sequences a prefill adds together
        before adding them: one reallocation, not one per :data:`ROWS` of them."""
        have_rows, have_columns = self._shape()
        if rows > have_rows or columns > have_columns:
            grown = _ceil(columns, COLUMNS) + COLUMNS if columns > have_columns else have_columns
            self._resize(max(have_rows, _ceil(rows, ROWS)), grown, like, layers)

    def _shape(self) -> tuple[int, int]:
        return (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)

    def _resize(self, rows: int, columns: int, like: torch.Tensor, layers: int) -> None:
        shape = (rows, like.shape[1], columns, like.shape[3])
        n, length = len(self.lengths), max(self.lengths, default=0)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]
            for o, t in zip(old, new, strict=False):
                t[:n, :, :length] = o[:n, :, :length]
            setattr(self, name, new)
