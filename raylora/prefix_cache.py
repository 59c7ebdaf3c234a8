"""The prefix cache of the generation engine: the keys and values of prompts' first tokens, kept per adapter.

A prompt is cut into blocks of :data:`BLOCK` tokens. A block's key is a digest chained over the adapter and every
token up to the block's end, so a block is found only after the same adapter and the same tokens before it: an
adapter's keys and values differ from the base's and from any other adapter's, and are never shared across them. A
later request reuses the longest run of cached blocks its prompt starts with (at most all but its last token, which
the engine runs to get the first logits) and prefills only the rest. Blocks are bounded in bytes and evicted least
recently used first; a lookup refreshes a prefix from its last block to its first, so a prefix's first blocks, which
every longer prefix needs, go last. Everything runs on the engine thread: no locks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

BLOCK = 16  # tokens per cached block


@dataclass
class _Block:
    adapter: str
    keys: list[torch.Tensor]  # per layer (kv heads, BLOCK, head dim)
    values: list[torch.Tensor]
    nbytes: int


class PrefixCache:
    """Cached prompt blocks per adapter, at most ``max_bytes`` of keys and values.

    Attributes:
        lookups, hits: requests looked up, and those that reused at least one block.
        tokens_saved: prompt tokens not prefilled thanks to the cache.
        evicted: blocks dropped for room.
    """

    def __init__(self, max_bytes: int, config):
        self.max_bytes, self.config = max_bytes, config
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.bytes = 0
        self.lookups = self.hits = self.tokens_saved = self.evicted = 0

    def match(self, adapter: str | None, ids: list[int]) -> tuple[int, DynamicCache | None]:
        """The cached tokens ``ids`` starts with for ``adapter`` (a multiple of :data:`BLOCK`, below ``len(ids)``)
        and a cache holding their keys and values (batch 1), or ``(0, None)``."""
        self.lookups += 1
        found = []
        for key in _keys(adapter, ids[: len(ids) - 1]):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
        if not found:
            return 0, None
        for key, _ in reversed(found):
            self._blocks.move_to_end(key)
        cache = DynamicCache(config=self.config)
        for layer in range(len(found[0][1].keys)):
            keys = torch.cat([b.keys[layer] for _, b in found], dim=1)[None]
            values = torch.cat([b.values[layer] for _, b in found], dim=1)[None]
            cache.update(keys, values, layer)
        tokens = BLOCK * len(found)
        self.hits += 1
        self.tokens_saved += tokens
        return tokens, cache

    def store(self, adapter: str | None, ids: list[int], cache, row: int, start: int) -> None:
        """Keep the full blocks of prompt ``ids`` from row ``row`` of ``cache``, whose keys and values of ``ids``
        begin at column ``start`` (after the row's left padding)."""
        new = []
        for k, key in enumerate(_keys(adapter, ids)):
            if key in self._blocks:
                new.append(key)
                continue
            s = start + k * BLOCK
            keys = [layer.keys[row, :, s : s + BLOCK].clone() for layer in cache.layers]
            values = [layer.values[row, :, s : s + BLOCK].clone() for layer in cache.layers]
            nbytes = sum(t.numel() * t.element_size() for t in keys + values)
            if nbytes > self.max_bytes:
                return
            self._blocks[key] = _Block(adapter or "", keys, values, nbytes)
            self.bytes += nbytes
            new.append(key)
        for key in reversed(new):
            self._blocks.move_to_end(key)
        while self.bytes > self.max_bytes:
            _, block = self._blocks.popitem(last=False)
            self.bytes -= block.nbytes
            self.evicted += 1

    def drop(self, adapter: str) -> None:
        """Forget every block of ``adapter`` (loaded anew, or unloaded: its weights may differ next time)."""
        for key in [k for k, b in self._blocks.items() if b.adapter == adapter]:
            self.bytes -= self._blocks.pop(key).nbytes


def sized(megabytes: float, config) -> PrefixCache | None:
    """A prefix cache of ``megabytes`` (``serve.prefix_cache_mb``) for a model of ``config``; None for 0 (off)."""
    return PrefixCache(int(megabytes * 2**20), config) if megabytes else None


def _keys(adapter: str | None, ids: list[int]) -> list[bytes]:
    """The chained digest of each full block of ``ids`` under ``adapter``."""
    digest = hashlib.blake2b((adapter or "").encode(), digest_size=16).digest()
    tokens = np.asarray(ids[: len(ids) - len(ids) % BLOCK], dtype=np.int64).reshape(-1, BLOCK)
    keys = []
    for block in tokens:
        digest = hashlib.blake2b(digest + block.tobytes(), digest_size=16).digest()
        keys.append(digest)
    return keys
