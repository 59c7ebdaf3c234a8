"""The model deployment: one replica holds the base model (quantised if asked), its engine, and an adapter LRU.

Adapters are loaded through Ray Serve's model multiplexing, so the router sends a request for adapter A
to a replica that already holds A; the LRU size is ``serve.max_adapters``. The replica asks its
:class:`~raylora.serve.bank.AdapterBank`, the one writer of the model's adapters, to attach an adapter, release one
the LRU evicted, and keep one a request uses until it reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path

from jinja2 import TemplateError
from ray import serve

from raylora.backends import resolve_backend
from raylora.config import JobConfig, from_dict
from raylora.data.encode import Encoder, tokenizer_spec
from raylora.data.formats import Conversation
from raylora.generation import Engine, Event, GenRequest, joined, on_passing_thread
from raylora.models import load_model, own_weights
from raylora.ops.int8 import FEW_ROWS, fuse_shared_inputs, int8_matmul_kernel
from raylora.prefix_cache import sized
from raylora.quantize import quantize
from raylora.registry import AdapterError
from raylora.serve.adapters import fetch_registered, local_adapter
from raylora.serve.bank import AdapterBank
from raylora.serve.metrics import ServingMetrics
from raylora.serve.protocol import ApiError
from raylora.serve.structured import Grammars, grammar
from raylora.tracking import tracking_uri

log = logging.getLogger("ray.serve")


def load_serving_model(cfg: JobConfig):
    """The base model and tokenizer as served: on the replica's device, quantised per ``serve.quantization``.

    Returns:
        ``(model, tokenizer, summary)``; ``summary`` describes the quantisation (empty for ``none``).
    """
    model, tokenizer = load_model(cfg.model)
    backend = resolve_backend(cfg.backend)
    summary: dict = {}
    if cfg.serve.quantization != "none":
        summary = quantize(model, tokenizer, cfg, cfg.serve.quantization)
        # what quantisation left in the checkpoint's memory map (embeddings, norms) kept the whole file resident, and
        # its calibration's activations stayed in the heap: SmolLM2-135M W8A8, 1,293 -> 756 MB resident
        own_weights(model)
        backend.release_freed_memory()
    model = model.to(backend.torch_device())
    # int8 q, k, v and gate, up (quantised here or an int8 folder): one matmul each
    if fuse_shared_inputs(model) and int8_matmul_kernel(backend.torch_device(), FEW_ROWS) == "float32 matmul":
        log.warning(
            f"int8 matmuls of {FEW_ROWS} rows or more run here as float32 matmuls of the int8 values (torch._int_mm "
            "was slower on a timed probe: this CPU has no int8 dot-product instructions): the same answers, each "
            "weight converted at each call; an unquantised base (serve.quantization: none) may serve faster here, "
            "with 4x the weight memory"
        )
    return model, tokenizer, summary


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
        threads = cfg.serve.engine_threads or max(1, round(cfg.serve.cpus_per_replica))
        model, self.tokenizer, self.quantization = on_passing_thread(lambda: load_serving_model(cfg), threads)
        self.base = model
        self.encoder = Encoder(tokenizer_spec(self.tokenizer, cfg.data.template), cfg.data.cutoff_len, "tail", False)
        self.hermes_calls = self.encoder.writes_hermes_calls()
        vocab = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        self.token_chars = max(len(token) for token in vocab if token)  # the most text one token stands for
        self.metrics = ServingMetrics(cfg.model.name_or_path)
        self.engine = Engine(model, self.tokenizer, cfg.serve.max_batch_size, cfg.serve.batch_wait_ms / 1000, threads,
                             cfg.serve.max_prefill_tokens, prefix_cache=sized(cfg.serve.prefix_cache_mb, model.config),
                             observer=self.metrics, on_idle=resolve_backend(cfg.backend).release_freed_memory)  # fmt: skip
        self.root = Path(cfg.serve.adapter_root).resolve()
        self.bank = AdapterBank(self.engine, self.base, cfg.serve, bool(self.quantization), self.metrics)
        self.grammars: Grammars | None = None  # built at the first constrained request

        async def adapter(name: str) -> _Held:  # Serve keeps its LRU on a function, not on a bound method
            return await self._load(name)

        self._adapter = serve.multiplexed(max_num_models_per_replica=cfg.serve.max_adapters)(adapter)

    async def _load(self, name: str) -> _Held:
        path = await asyncio.to_thread(self._find, name)
        await self.bank.hold(name, path)
        return _Held(self, name)

    def _find(self, name: str) -> Path:
        try:
            return local_adapter(self.root, name)
        except AdapterError as e:
            if e.status != 404 or not self.cfg.tracking.enabled:
                raise
        return fetch_registered(tracking_uri(self.cfg.tracking), name, self.root)

    def retire(self, name: str) -> None:
        """Serve's LRU evicted ``name``."""
        self.bank.release(name)

    def render(self, messages: list[dict] | None, prompt: str | None, tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids: a conversation (and the functions it may call) through the chat template, as training
        renders it (:meth:`~raylora.data.encode.Encoder.template_view`); or a completion prompt as is.

        Raises:
            ApiError: 400 when the chat template refuses the conversation (``raise_exception``).
        """
        if messages is None:
            return self.tokenizer(prompt).input_ids
        try:
            text = self.encoder.prompt(Conversation(messages, tools))
        except TemplateError as e:  # templates refuse some conversations (Llama 3.1: one tool call a turn)
            raise ApiError(400, f"this model's chat template refuses the conversation: {e}", "messages",
                           "invalid_value") from None  # fmt: skip
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def structure(self, request: dict) -> str | None:
        """The grammar the answer must follow (:func:`~raylora.serve.structured.grammar`), or ``None``.

        Raises:
            ApiError: 400 when calls must be written and this model's template writes them in a format other than
                the Hermes ``<tool_call>`` JSON the grammar writes.
        """
        forced = request["tool_choice"] in ("required", "function")
        calls = forced or (request["tool_choice"] == "auto" and request["response_format"] is not None)
        if calls and not self.hermes_calls:
            raise ApiError(
                400, f"tool_choice={request['tool_choice']!r} with this request holds the answer to <tool_call> JSON "
                "calls, and this model's chat template writes calls in another format: use tool_choice 'auto' "
                "without response_format", "tool_choice", "unsupported_value",
            )  # fmt: skip
        return grammar(request["response_format"], request["tools"], request["tool_choice"], request["tool_name"],
                       request["parallel_tool_calls"])  # fmt: skip

    def constraint(self, text: str):
        """A fresh constraint following grammar ``text``; the first builds the replica's :class:`Grammars`."""
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.base.config.vocab_size, self.engine.eos_ids)
        return self.grammars.start(text)

    def check_chars(self, request: dict, field: str) -> None:
        """Refuse, before tokenising it, a prompt with more characters than the longest prompt accepted can hold.

        A token stands for at most :attr:`token_chars` characters (the longest vocabulary entry; byte-level entries
        are a character a byte), so such a prompt cannot fit; a 4x margin covers normalisers that join characters.
        Tokenising runs on the replica's event loop: before this check a 20 MB prompt held every other request for
        40 s, only to be refused.

        Raises:
            ApiError: 400 ``context_length_exceeded``.
        """
        if request["messages"] is None:
            chars = len(request["prompt"])
        else:  # tool schemas and calls count as the JSON the template shows
            extra = [m.get("tool_calls") for m in request["messages"]] + [request["tools"]]
            chars = sum(len(m["content"]) for m in request["messages"]) + len(json.dumps(extra, ensure_ascii=False))
        longest = min(self.cfg.serve.max_prompt_tokens or self.engine.max_context, self.engine.max_context - 1)
        if chars > 4 * longest * self.token_chars:
            raise ApiError(
                400, f"the prompt has {chars} characters, far more than the {longest} tokens this server accepts "
                "can hold: shorten the prompt", field, "context_length_exceeded",
            )  # fmt: skip

    def budget(self, prompt_tokens: int, max_tokens: int | None, field: str) -> int:
        """The tokens a request may generate: its ``max_tokens``, else ``serve.max_tokens`` or what the context has left.

        Raises:
            ApiError: 400 ``context_length_exceeded`` when the prompt is longer than ``serve.max_prompt_tokens``,
                leaves no room in the context, or with the given ``max_tokens`` does not fit.
        """
        context = self.engine.max_context
        longest = min(self.cfg.serve.max_prompt_tokens or context, context - 1)
        if prompt_tokens > longest:
            raise ApiError(
                400, f"the prompt has {prompt_tokens} tokens; this server accepts at most {longest} (the model's "
                f"context is {context} tokens, serve.max_prompt_tokens is {self.cfg.serve.max_prompt_tokens}): "
                "shorten the prompt", field, "context_length_exceeded",
            )  # fmt: skip
        if max_tokens is None:
            return min(self.cfg.serve.max_tokens, context - prompt_tokens)
        if prompt_tokens + max_tokens > context:
            raise ApiError(
                400, f"this model's context is {context} tokens; the prompt has {prompt_tokens} and max_tokens is "
                f"{max_tokens}: shorten the prompt or lower max_tokens", "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        return max_tokens

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """Stream :class:`Event` dicts for one request.

        Args:
            request: ``messages`` (and ``tools``, ``tool_choice``, ``tool_name``, ``parallel_tool_calls``) or
                ``prompt``, ``max_tokens`` (None: serve.max_tokens), ``temperature``, ``top_p``, ``stop``, ``seed``,
                ``response_format``, ``stream`` (False: one event, the whole answer); the adapter is the multiplexed
                model id (empty: the base).
        A refused request (400 ``context_length_exceeded``, see :meth:`check_chars` and :meth:`budget`; an adapter
        error with its status) is one event ``{"refused": {status, message, param, code, type}}``.
        """
        adapter = serve.get_multiplexed_model_id() or None
        refused = None
        try:
            with self.bank.pinned(adapter):
                seq, queue = await self._submit(request, adapter)
        except ApiError as e:
            refused = e
        except AdapterError as e:
            refused = ApiError(e.status, str(e), "model", e.code)
        if refused is not None:  # yielded, not raised: Serve logs a traceback for every exception a replica raises
            yield {"refused": refused.body()["error"] | {"status": refused.status}}
            return
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
            self.bank.collect_soon()

    async def _submit(self, request: dict, adapter: str | None):
        """Render, check and submit one request (its adapter loaded first); returns its sequence and event queue."""
        field = "prompt" if request["messages"] is None else "messages"
        self.check_chars(request, field)
        ids = self.render(request["messages"], request["prompt"], request["tools"])
        max_tokens = self.budget(len(ids), request["max_tokens"], field)
        text = self.structure(request)
        constraint = await asyncio.to_thread(self.constraint, text) if text else None  # compiling may take 100 ms
        if adapter:
            await self._adapter(adapter)
        req = GenRequest(ids, adapter, max_tokens, request["temperature"], request["top_p"], tuple(request["stop"]),
                         request["seed"], constraint)  # fmt: skip
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        seq = self.engine.submit(req, lambda e: loop.call_soon_threadsafe(queue.put_nowait, e))
        return seq, queue

    def info(self) -> dict:
        """What this replica runs: pid, quantisation summary, loaded adapters (for probes and tests)."""
        return {"pid": os.getpid(), "quantization": self.quantization, "adapters": self.bank.attached()}

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("the generation engine thread has stopped")
