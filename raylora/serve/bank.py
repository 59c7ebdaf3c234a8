"""The adapter bank: the one writer of the served model's adapters.

It attaches an adapter when a request needs it, releases one when Serve's LRU evicts it, and detaches the
released ones that no request uses any more. Attaching and detaching run on the engine thread (between decode
steps, where the model may change); the bank keeps what the LRU holds (``held``), what requests between loading
their adapter and reaching the engine use (``pinned``), and what the model holds (``attached``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import PeftModel

from raylora.config import ServeArgs
from raylora.generation import Engine
from raylora.ops.int4 import quantize_adapter
from raylora.ops.lora import stack_adapters
from raylora.registry import AdapterError
from raylora.serve.compat import check_compatible

log = logging.getLogger("ray.serve")


class AdapterBank:
    """The adapters of ``engine``'s model, over the unadapted ``base``.

    Args:
        serve: the serving settings (``max_lora_rank``, ``adapter_bits``, ``adapter_group_size``, ``quantization``).
        quantized: the base holds int8 weights (DoRA is refused on them).
        metrics: told of each load and unload (:class:`~raylora.serve.metrics.ServingMetrics`), or None.
    """

    def __init__(self, engine: Engine, base: torch.nn.Module, serve: ServeArgs, quantized: bool, metrics=None):
        self.engine, self.base, self.serve, self.quantized, self.metrics = engine, base, serve, quantized, metrics
        self._held: set[str] = set()  # adapters Serve's LRU holds
        self._attached: set[str] = set()  # adapters in the model; changed on the engine thread only
        self._pinned: Counter[str] = Counter()  # requests between loading their adapter and reaching the engine
        self._lock = threading.Lock()

    async def hold(self, name: str, path: Path) -> None:
        """Attach adapter ``name`` from ``path`` (once) and count it as held by the LRU."""
        await asyncio.wrap_future(self.engine.call(lambda: self._attach(name, path)))
        with self._lock:
            self._held.add(name)

    def release(self, name: str) -> None:
        """Serve's LRU evicted ``name``: detach it once no request uses it."""
        with self._lock:
            self._held.discard(name)
        self.collect_soon()

    @contextlib.contextmanager
    def pinned(self, name: str | None) -> Iterator[None]:
        """While a request loads adapter ``name`` and until it reaches the engine, the adapter stays attached."""
        with self._lock:
            self._pinned[name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pinned[name] -= 1

    def attached(self) -> list[str]:
        with self._lock:
            return sorted(self._attached)

    def collect_soon(self) -> None:
        """Queue a collection on the engine thread when an attached adapter is no longer held."""
        with self._lock:
            if self._attached - self._held:
                self.engine.call(self._collect)

    def _attach(self, name: str, path: Path) -> None:
        """Engine thread: add adapter ``name`` to the model (idempotent)."""
        if name in self._attached:
            return
        self._forget_prefixes(name)  # the name's earlier weights may have been other ones
        model = self.engine.model
        config = check_compatible(path, self.base, self.serve.max_lora_rank)
        if config.get("use_dora") and self.quantized:
            # DoRA reads the base weight as floats; on int8 weights its answers would be silently wrong.
            raise AdapterError(422, "adapter_incompatible", f"adapter {name!r} is DoRA, which cannot run on the "
                               f"int8 base (serve.quantization={self.serve.quantization}); serve it with "
                               "serve.quantization=none")  # fmt: skip
        if hasattr(model, "peft_config"):
            model.load_adapter(str(path), adapter_name=name)
        else:
            model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
        self.engine.model = model.eval()
        if self.serve.adapter_bits == 4:
            quantize_adapter(model, name, self.serve.adapter_group_size)
        stack_adapters(model)
        with self._lock:
            self._attached.add(name)
            count = len(self._attached)
        if self.metrics is not None:
            self.metrics.adapter(True, count)
        log.info("adapter %s loaded from %s", name, path)

    def _forget_prefixes(self, name: str) -> None:
        """Engine thread: drop adapter ``name``'s cached prompt prefixes."""
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.drop(name)

    def _collect(self) -> None:
        """Engine thread: detach every adapter that the LRU does not hold and no request uses."""
        with self._lock:
            keep = self._held | set(+self._pinned)
        # Read after ``keep``: a request is pinned until it is in the engine, so none slips between the two.
        keep |= self.engine.adapters_in_use()
        drop = sorted(self._attached - keep)
        if not drop:
            return
        model = self.engine.model
        for name in drop:
            model.delete_adapter(name)
            self._forget_prefixes(name)
            with self._lock:
                self._attached.discard(name)
                count = len(self._attached)
            if self.metrics is not None:
                self.metrics.adapter(False, count)
            log.info("adapter %s unloaded", name)
        if self._attached:
            stack_adapters(model)
        else:
            # peft keeps a deleted last adapter as the active one, and every later forward fails on it.
            self.engine.model = model.unload()
