"""The model deployment: one replica holds the base model (quantised if asked), its engine, and an adapter LRU.

Adapters are loaded through Ray Serve's model multiplexing, so the router sends a request for adapter A
to a replica that already holds A; the LRU size is ``serve.max_adapters``. An adapter the LRU evicts is
detached only once no request still decoding uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path

import torch
from ray import serve

from raylora.config import JobConfig, from_dict
from raylora.ops.lora import stack_adapters
from raylora.serve.adapters import AdapterError, check_compatible, fetch_registered, local_adapter
from raylora.serve.engine import Engine, Event, GenRequest, joined
from raylora.serve.protocol import ApiError

log = logging.getLogger("ray.serve")


def load_serving_model(cfg: JobConfig):
    """The base model and tokenizer as served: on the replica's device, quantised per ``serve.quantization``.

    Returns:
        ``(model, tokenizer, summary)``; ``summary`` describes the quantisation (empty for ``none``).
    """
    from raylora.backends import resolve_backend
    from raylora.models import load_model

    model, tokenizer = load_model(cfg.model)
    summary: dict = {}
    if cfg.serve.quantization != "none":
        from raylora.export import quantize

        summary = quantize(model, tokenizer, cfg, cfg.serve.quantization)
    return model.to(resolve_backend(cfg.backend).torch_device()), tokenizer, summary


class _Held:
    """What the multiplexer keeps per adapter; Serve calls ``__del__`` when its LRU evicts it."""

    def __init__(self, server: LLMServer, name: str):
        self.server, self.name, self.evicted = server, name, False

    def __del__(self):
        # Serve calls this on eviction, and Python calls it again when the object is collected, by which
        # time the adapter may be loaded anew for the LRU: only the first call retires it.
        if not self.evicted:
            self.evicted = True
            self.server.retire(self.name)


class LLMServer:
    """One model replica (the Serve deployment body; usable without Serve in tests).

    Args:
        cfg: the job configuration as a plain dict (``config.to_dict``).
    """

    def __init__(self, cfg: dict):
        self.cfg = cfg = from_dict(cfg)
        torch.set_num_threads(max(1, round(cfg.serve.cpus_per_replica)))
        from raylora.data.encode import Encoder, tokenizer_spec

        model, self.tokenizer, self.quantization = load_serving_model(cfg)
        self.base = model
        self.encoder = Encoder(tokenizer_spec(self.tokenizer, cfg.data.template), cfg.data.cutoff_len, "tail", False)
        threads = cfg.serve.engine_threads or max(1, round(cfg.serve.cpus_per_replica))
        self.engine = Engine(model, self.tokenizer, cfg.serve.max_batch_size, cfg.serve.batch_wait_ms / 1000, threads)
        self.root = Path(cfg.serve.adapter_root).resolve()
        self._retired: set[str] = set()
        self._pinned: Counter[str] = Counter()  # requests between loading their adapter and reaching the engine
        self._lock = threading.Lock()

        async def adapter(name: str) -> _Held:  # Serve keeps its LRU on a function, not on a bound method
            return await self._load(name)

        self._adapter = serve.multiplexed(max_num_models_per_replica=cfg.serve.max_adapters)(adapter)

    async def _load(self, name: str) -> _Held:
        with self._lock:
            self._retired.discard(name)
        path = await asyncio.to_thread(self._find, name)
        await asyncio.wrap_future(self.engine.call(lambda: self._attach(name, path)))
        return _Held(self, name)

    def _find(self, name: str) -> Path:
        try:
            return local_adapter(self.root, name)
        except AdapterError as e:
            if e.status != 404 or not self.cfg.tracking.enabled:
                raise
        from raylora.tracking import tracking_uri

        return fetch_registered(tracking_uri(self.cfg.tracking), name, self.root)

    def _attach(self, name: str, path: Path) -> None:
        """Engine thread: add adapter ``name`` to the model (idempotent)."""
        from peft import PeftModel

        model = self.engine.model
        if hasattr(model, "peft_config") and name in model.peft_config:
            return
        config = check_compatible(path, self.base, self.cfg.serve.max_lora_rank)
        if config.get("use_dora") and self.quantization:
            # DoRA reads the base weight as floats; on int8 weights its answers would be silently wrong.
            raise AdapterError(422, "adapter_incompatible", f"adapter {name!r} is DoRA, which cannot run on the "
                               f"int8 base (serve.quantization={self.cfg.serve.quantization}); serve it with "
                               "serve.quantization=none")  # fmt: skip
        if hasattr(model, "peft_config"):
            model.load_adapter(str(path), adapter_name=name)
        else:
            model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
        self.engine.model = model.eval()
        if self.cfg.serve.adapter_bits == 4:
            from raylora.ops.int4 import quantize_adapter

            quantize_adapter(model, name, self.cfg.serve.adapter_group_size)
        stack_adapters(model)
        log.info("adapter %s loaded from %s", name, path)

    def retire(self, name: str) -> None:
        """The LRU evicted ``name``: detach it once no request uses it."""
        with self._lock:
            self._retired.add(name)
        self._sweep()

    def _sweep(self) -> None:
        with self._lock:
            idle = self._retired - self.engine.adapters_in_use() - set(+self._pinned)
            self._retired -= idle
        for name in idle:
            self.engine.call(lambda name=name: self._detach(name))

    def _detach(self, name: str) -> None:
        model = self.engine.model
        with self._lock:
            if name in self.engine.adapters_in_use() or self._pinned[name]:
                self._retired.add(name)
                return
        if hasattr(model, "peft_config") and name in model.peft_config:
            model.delete_adapter(name)
            stack_adapters(model)
            log.info("adapter %s unloaded", name)

    def render(self, messages: list[dict[str, str]] | None, prompt: str | None) -> list[int]:
        """Prompt token ids: a conversation through the chat template, or a completion prompt as is."""
        if messages is not None:
            return self.tokenizer(
                self.encoder.render(messages, add_generation_prompt=True), add_special_tokens=False
            ).input_ids
        return self.tokenizer(prompt).input_ids

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """Stream :class:`Event` dicts for one request.

        Args:
            request: ``messages`` or ``prompt``, ``max_tokens`` (None: serve.max_tokens), ``temperature``,
                ``top_p``, ``stop``, ``seed``, ``stream`` (False: one event, the whole answer); the adapter is
                the multiplexed model id (empty: the base).
        Raises:
            ApiError: 400 when the prompt plus max_tokens exceeds the context; adapter errors with their status.
        """
        adapter = serve.get_multiplexed_model_id() or None
        with self._lock:
            self._pinned[adapter] += 1
        try:
            if adapter:
                await self._adapter(adapter)
            ids = self.render(request["messages"], request["prompt"])
            max_tokens = request["max_tokens"] or min(self.cfg.serve.max_tokens, self.engine.max_context - len(ids))
            if len(ids) + max_tokens > self.engine.max_context:
                raise ApiError(
                    400, f"this model's context is {self.engine.max_context} tokens; the prompt has {len(ids)} and "
                    f"max_tokens is {max_tokens}: shorten the prompt or lower max_tokens", "max_tokens", "context_length_exceeded",
                )  # fmt: skip
            req = GenRequest(ids, adapter, max_tokens, request["temperature"], request["top_p"], tuple(request["stop"]),
                             request["seed"])  # fmt: skip
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Event] = asyncio.Queue()
            seq = self.engine.submit(req, lambda e: loop.call_soon_threadsafe(queue.put_nowait, e))
        finally:
            with self._lock:
                self._pinned[adapter] -= 1
        try:
            while True:
                # One message per burst of tokens (per answer when not streaming): each crosses processes.
                events = [await queue.get()]
                while not events[-1].final and (not request["stream"] or not queue.empty()):
                    events.append(await queue.get())
                yield asdict(joined(events))
                if events[-1].final:
                    return
        finally:
            seq.cancel()
            if self._retired:
                self._sweep()

    def info(self) -> dict:
        """What this replica runs: pid, quantisation summary, loaded adapters (for probes and tests)."""
        model = self.engine.model
        loaded = sorted(model.peft_config) if hasattr(model, "peft_config") else []
        return {"pid": os.getpid(), "quantization": self.quantization, "adapters": loaded}

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("the generation engine thread has stopped")
