"""The generation engine: continuous batching across LoRA adapters, for a serving replica, an eval actor and the
quickstart's answers (the one generation loop of raylora).

One thread owns the model. Each turn of its loop runs at most ``max_prefill_tokens`` prompt tokens of
prefill, then one decode step for every running sequence: short prompts that arrive together are prefilled
as one left-padded batch, a long prompt is prefilled in chunks over several turns, so it never stalls the
running streams for more than one chunk. A prefilled sequence's KV cache is left-padded and concatenated
onto the running batch's; finished sequences leave at once; every decode step is one forward pass for all
running sequences whatever adapter each uses (peft's mixed-batch ``adapter_names``). Adapter loads and
unloads run on the same thread between turns, so a forward pass never sees the model change under it.
Text is detokenised incrementally (tokenizers' ``DecodeStream``) and stop strings are looked for only in
the new tail, so each token costs the same however long the answer grows. A request with a constraint (a JSON
schema, forced tool calls: :mod:`raylora.serve.structured`) has its own row of logits masked before sampling; the
other rows of the batch are untouched.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from tokenizers.decoders import DecodeStream
from transformers import DynamicCache

from raylora.kv_slots import Slots
from raylora.ops import engine_attention, lora
from raylora.prefix_cache import PrefixCache

T = TypeVar("T")
BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


class Observer(Protocol):
    """What the engine tells about its work (:class:`raylora.serve.metrics.ServingMetrics` exports it to Ray's
    metrics); every call comes from the engine thread."""

    def queue(self, running: int, waiting: int) -> None: ...

    def token(self, seconds: float, first: bool) -> None: ...

    def finished(self, prompt_tokens: int, generated_tokens: int) -> None: ...

    def prefix(self, queried: int, hit: int, cached_bytes: int) -> None: ...


class Constraint(Protocol):
    """What the engine asks of a constrained request (:class:`raylora.serve.structured.Constraint`)."""

    def mask(self, logits: torch.Tensor) -> None: ...

    def accept(self, token: int) -> None: ...

    @property
    def done(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


@dataclass
class GenRequest:
    """One generation: token ids in, text out.

    Attributes:
        prompt_ids: the rendered prompt's token ids.
        adapter: adapter name, or None for the base model.
        max_tokens: generated tokens at most.
        temperature: 0 decodes greedily.
        top_p: nucleus sampling mass.
        stop: strings that end the answer (not included in it).
        seed: makes sampling repeatable.
        constraint: what the answer must follow (its logits are masked), or None; one per request.
    """

    prompt_ids: list[int]
    adapter: str | None = None
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    constraint: Constraint | None = None


@dataclass
class Event:
    """What a request hears from the engine: text deltas, then one final event with the finish reason."""

    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" on the final event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (final event)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def joined(events: list[Event]) -> Event:
    """Consecutive events of one request as one: their text, and the last one's ending."""
    last = events[-1]
    text = "".join(e.text for e in events)
    return Event(text, last.finish_reason, last.prompt_tokens, last.completion_tokens, last.error, last.cached_tokens)


@dataclass
class _Seq:
    req: GenRequest
    emit: Callable[[Event], None]
    generator: torch.Generator
    decoder: DecodeStream
    ids: list[int] = field(default_factory=list)  # generated so far
    text: str = ""  # ``ids`` detokenised
    sent: int = 0  # characters of ``text`` already emitted
    prefilled: int = 0  # prompt tokens already in ``cache`` (a prompt prefilled in chunks, or found cached)
    cached: int = 0  # of them, those the prefix cache gave
    submitted: float = field(default_factory=time.monotonic)
    last: float = 0.0  # when the last token was emitted (0: none yet)
    cache: object = None
    cancelled: bool = False
    failed: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """Continuous-batching generation over a (possibly peft-wrapped) causal LM.

    Args:
        model: a Hugging Face causal LM in eval mode, or a peft model around one.
        tokenizer: its tokenizer (a fast, tokenizers-backed one: incremental decoding, end-of-sequence ids).
        max_batch_size: sequences decoded together; 1 turns batching off.
        batch_wait_s: how long an idle engine waits for more requests before starting a batch.
        threads: torch intra-op threads of the engine thread (None: torch's default).
        max_prefill_tokens: prompt tokens prefilled per turn, between two decode steps of the running batch
            (None: every prompt is prefilled whole, however long).
        autocast: a context manager factory every forward runs under (``Backend.autocast``, for a model whose frozen
            weights training stored in the autocast dtype); autocast is per thread, so the engine enters it itself.
        prefix_cache: keeps prompts' keys and values per adapter for later requests that start the same way
            (:class:`~raylora.prefix_cache.PrefixCache`), or None.
        observer: told of the queue, each token's latency, each finished request and each prefix lookup, or None.
        on_idle: called on the engine thread each time its last sequence ends, in a decode step or at its prefill (a
            replica hands the heap's freed pages back then: ``Backend.release_freed_memory``).
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_batch_size: int,
        batch_wait_s: float,
        threads: int | None = None,
        max_prefill_tokens: int | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        prefix_cache: PrefixCache | None = None,
        observer: Observer | None = None,
        on_idle: Callable[[], None] = lambda: None,
    ):
        self.model = model
        self.on_idle = on_idle
        self.prefix_cache, self.observer = prefix_cache, observer
        self.autocast = autocast
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_prefill_tokens = max_prefill_tokens or sys.maxsize
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.max_context = model.config.max_position_embeddings
        self._cv = threading.Condition()
        self._waiting: list[_Seq] = []
        self._calls: list[tuple[Callable, Future]] = []
        self._prefilling: list[_Seq] = []  # admitted, prompt not yet (wholly) in a cache; touched by the engine only
        self._running: list[_Seq] = []
        self._cache: Slots | None = None  # the running sequences' keys and values, row i for self._running[i]
        self._next: torch.Tensor | None = None  # (batch, 1) the token each sequence feeds next
        self._stopping = False
        self.threads = threads
        self.max_running = 0  # the largest batch decoded so far (tests, benchmarks)
        self._thread = threading.Thread(target=self._loop, name="raylora-engine", daemon=True)
        self._thread.start()

    def submit(self, req: GenRequest, emit: Callable[[Event], None]) -> _Seq:
        """Queue a request; ``emit`` is called from the engine thread. Returns a handle with ``cancel()``."""
        gen = torch.Generator()
        gen.manual_seed(req.seed) if req.seed is not None else gen.seed()
        seq = _Seq(req, emit, gen, DecodeStream(skip_special_tokens=True))
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify()
        return seq

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the engine thread between decode steps (adapter loads and unloads)."""
        future: Future = Future()
        with self._cv:
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def adapters_in_use(self) -> set[str]:
        with self._cv:
            return {s.req.adapter for s in self._waiting + self._prefilling + self._running if s.req.adapter}

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.threads:
            torch.set_num_threads(self.threads)
        while True:
            with self._cv:
                while not (self._running or self._prefilling or self._waiting or self._calls or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    return
                if not (self._running or self._prefilling) and self._waiting and self.batch_wait_s:
                    self._cv.wait_for(lambda: len(self._waiting) >= self.max_batch_size, self.batch_wait_s)
                calls, self._calls = self._calls, []
                room = self.max_batch_size - len(self._running) - len(self._prefilling)
                admitted = self._waiting[:room]
                self._prefilling += admitted
                self._waiting = self._waiting[room:]
                self._prefilling = [s for s in self._prefilling if not s.cancelled]
            if self.prefix_cache is not None:
                for seq in admitted:
                    seq.cached, seq.cache = self.prefix_cache.match(seq.req.adapter, seq.req.prompt_ids)
                    seq.prefilled = seq.cached
                    if self.observer is not None:
                        self.observer.prefix(len(seq.req.prompt_ids), seq.cached, self.prefix_cache.bytes)
            if self.observer is not None:
                self.observer.queue(len(self._running) + len(self._prefilling), len(self._waiting))
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except Exception as e:  # the caller gets the reason; the engine keeps serving
                    future.set_exception(e)
            busy = bool(self._prefilling or self._running)
            if self._prefilling:
                chunk = self._next_chunk()
                self._guarded(chunk, self._prefill, chunk)
            if self._running:
                self._guarded(list(self._running), self._step)
            if busy and not (self._running or self._prefilling):
                self.on_idle()

    def _guarded(self, seqs: list[_Seq], work: Callable[..., None], *args) -> None:
        """Run ``work(*args)``; if it raises, fail ``seqs`` (each once) and drop them, and keep serving the rest."""
        try:
            work(*args)
        except Exception as e:  # a failed forward fails the requests it was for, not the replica
            failed = [s for s in seqs if not s.failed]
            for seq in failed:
                seq.failed = True
                seq.emit(Event(error=f"generation failed: {type(e).__name__}: {e}"))
            with self._cv:
                self._prefilling = [s for s in self._prefilling if not s.failed]
            if any(s.failed for s in self._running):
                self._running, self._cache, self._next = [], None, None

    def _chunk_tokens(self) -> int:
        """The most tokens of one prompt prefilled in a turn: ``max_prefill_tokens`` while sequences decode (it delays
        their next token), ``max_batch_size`` times that when none does (no one waits on it)."""
        return self.max_prefill_tokens * (1 if self._running else self.max_batch_size)

    def _next_chunk(self) -> list[_Seq]:
        """What is prefilled this turn: the short prompts waiting, together while what is left of them to prefill fits
        ``max_batch_size * max_prefill_tokens`` tokens (16 SmolLM2 W8A8 requests arriving together all had their first
        token after 0.65-0.74 s, against 0.05-1.45 s one prompt a turn; docs/serving.md); else the next chunk of a
        long prompt (short ones go first, so a long prompt never delays a new request's first token by more than a
        chunk; ``max_batch_size`` bounds how long they can keep it waiting). A prompt is short when what is left of it
        to prefill is: a prompt whose start the prefix cache held joins the others. Prompts of different adapters are
        prefilled together only on a model whose LoRA layers are all stacked (:func:`raylora.ops.lora.stacked`)."""
        budget = self.max_prefill_tokens * self.max_batch_size
        mixed = not hasattr(self.model, "peft_config") or lora.stacked(self.model)
        chunk, tokens = [], 0
        for seq in self._prefilling:
            if self._long(seq) or (chunk and not mixed and seq.req.adapter != chunk[0].req.adapter):
                continue
            tokens += len(seq.req.prompt_ids) - seq.prefilled
            if tokens > budget:
                break
            chunk.append(seq)
        return chunk or [next((s for s in self._prefilling if s.prefilled), self._prefilling[0])]

    def _long(self, seq: _Seq) -> bool:
        """Whether what is left of ``seq``'s prompt is prefilled in chunks."""
        return len(seq.req.prompt_ids) - seq.prefilled > self._chunk_tokens()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, seqs: list[_Seq], cache, **kwargs):
        """The model's forward over ``ids`` (batch, tokens), row ``i`` for ``seqs[i]``, or one packed row of
        ``kwargs["prefill"]``'s prompts (:meth:`_prefill`); returns its logits (rows or prompts, vocab) and cache."""
        names = [s.req.adapter or BASE for s in seqs]
        named = contextlib.nullcontext()
        if hasattr(self.model, "peft_config"):
            if lora.stacked(self.model):
                named = lora.adapters_of(
                    names, None if "prefill" not in kwargs else [n for _, _, n in kwargs["prefill"]]
                )
            else:  # peft's per-row names; a prefill's prompts share one adapter then (_next_chunk)
                kwargs["adapter_names"] = names[: len(ids)]
        device = self.model.device
        with self.autocast(), engine_attention.selected(self.model), named:
            out = self.model(input_ids=ids.to(device), position_ids=positions.to(device), cache=cache, use_cache=True,
                             **kwargs)  # fmt: skip
        logits = out.logits[0] if "prefill" in kwargs else out.logits[:, -1, :]
        return logits.float().cpu(), out.cache

    def _prefill(self, seqs: list[_Seq]) -> None:
        """One prefill forward: the next ``max_prefill_tokens`` of one long prompt, or several short prompts whole.

        The prompts lie side by side in one row, no padding: the linears run on their tokens only, and each prompt
        attends to its own keys (:func:`~raylora.ops.engine_attention.engine_attention`'s ``prefill``), those a
        sequence holds already (its cached start, its earlier chunks) first in the cache."""
        if self._long(seqs[0]):
            ends = [min(len(seqs[0].req.prompt_ids), seqs[0].prefilled + self._chunk_tokens())]
        else:
            ends = [len(s.req.prompt_ids) for s in seqs]
        held = [s for s in seqs if s.prefilled]
        past = None
        if held:
            past = DynamicCache(config=self.model.config)
            for layer in range(len(held[0].cache.layers)):
                past.update(torch.cat([s.cache.layers[layer].keys for s in held], dim=2),
                            torch.cat([s.cache.layers[layer].values for s in held], dim=2), layer)  # fmt: skip
        ids = torch.tensor(
            [[t for s, end in zip(seqs, ends, strict=True) for t in s.req.prompt_ids[s.prefilled : end]]]
        )
        positions = torch.cat([torch.arange(s.prefilled, end) for s, end in zip(seqs, ends, strict=True)])[None]
        prefill, held_at = [], 0  # per prompt: where its held columns start, how many, its new tokens
        for s, end in zip(seqs, ends, strict=True):
            prefill.append((held_at, s.prefilled, end - s.prefilled))
            held_at += s.prefilled
        firsts = torch.tensor([0] + [n for _, _, n in prefill]).cumsum(0)
        logits, cache = self._forward(ids, positions, seqs, past, prefill=prefill, logits_to_keep=firsts[1:] - 1)
        done = []
        for i, (s, end) in enumerate(zip(seqs, ends, strict=True)):
            s.cache = _row(cache, prefill[i][0], prefill[i][1], int(firsts[i]), prefill[i][2], held_at)
            s.prefilled = end
            if end == len(s.req.prompt_ids):
                self._keep_prefix(s, s.cache)
                done.append(i)
        if not done:
            return
        with self._cv:
            self._prefilling = [s for s in self._prefilling if s not in seqs]
        self._join([seqs[i] for i in done], logits[done])

    def _keep_prefix(self, seq: _Seq, cache) -> None:
        """Give the prefix cache ``seq``'s prompt blocks (``cache``: its keys and values, batch 1)."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(seq.req.adapter, seq.req.prompt_ids, cache, 0, 0)

    def _join(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Sample the first token of freshly prefilled ``seqs`` (each holding its prompt's keys and values); the
        unfinished ones join the running batch."""
        tokens = self._sample(logits, seqs)
        if self._cache is None:
            self._cache = Slots()
        like = seqs[0].cache.layers[0].keys
        self._cache.reserve(len(self._running) + len(seqs), max(len(s.req.prompt_ids) for s in seqs) + 1, like,
                            len(seqs[0].cache.layers))  # fmt: skip
        joined = []
        for i, (seq, token) in enumerate(zip(seqs, tokens[:, 0].tolist(), strict=True)):
            cache, seq.cache = seq.cache, None
            if seq.cancelled or self._advance(seq, token):
                continue
            keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
            self._cache.add(keys, values, 0, 0, len(seq.req.prompt_ids))
            self._running.append(seq)
            joined.append(i)
        if not self._running:
            self._cache = None
        if not joined:
            return
        tokens = tokens[joined]
        self._next = tokens if self._next is None else torch.cat([self._next, tokens])
        self.max_running = max(self.max_running, len(self._running))

    def _step(self) -> None:
        """One decode step of every running sequence; the finished and cancelled ones leave the batch."""
        mask, positions = self._cache.step()
        logits, _ = self._forward(self._next, positions, self._running, self._cache, attention_mask=mask,
                                  logits_to_keep=1)  # fmt: skip
        self._cache.stepped()
        self._next = tokens = self._sample(logits, self._running)
        ended = [i for i, (s, t) in enumerate(zip(self._running, tokens[:, 0].tolist(), strict=True))
                 if s.cancelled or self._advance(s, t)]  # fmt: skip
        for i in reversed(ended):  # the last row takes the place of a leaving one: the rows after i are unfinished
            last = len(self._running) - 1
            self._cache.remove(i)
            self._running[i] = self._running[last]
            self._running.pop()
            self._next[i] = self._next[last]
            self._next = self._next[:last]
        if not self._running:
            self._cache, self._next = None, None

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        """Next token per row of ``logits`` (batch, vocab) as (batch, 1): greedy at temperature 0, else top-p; a
        constrained request's row first loses the tokens its grammar forbids."""
        for i, s in enumerate(seqs):
            if s.req.constraint is not None:
                s.req.constraint.mask(logits[i])
        tokens = logits.argmax(-1)
        for i, s in enumerate(seqs):
            if s.req.temperature > 0:
                tokens[i] = _top_p_sample(logits[i] / s.req.temperature, s.req.top_p, s.generator)
        return tokens[:, None]

    def _advance(self, seq: _Seq, token: int) -> bool:
        """Record ``token`` for ``seq`` and send the text that is final; returns whether ``seq`` finished."""
        if self.observer is not None:
            now = time.monotonic()
            self.observer.token(now - (seq.last or seq.submitted), first=not seq.last)
            seq.last = now
        stops, constraint = seq.req.stop, seq.req.constraint
        if constraint is not None:
            constraint.accept(token)
            if constraint.error is not None:  # the request fails, the batch goes on
                seq.emit(Event(error=constraint.error))
                return True
        # Under a grammar the answer ends where the grammar does: an end id that is also text (a test model's) is text.
        if token in self.eos_ids and (constraint is None or constraint.done):
            reason, piece = "stop", ""
        else:
            seq.ids.append(token)
            piece = seq.decoder.step(self.tokenizer._tokenizer, token) or ""  # "": half a multi-byte character
            reason = "length" if len(seq.ids) >= seq.req.max_tokens else None
            if constraint is not None and constraint.done:  # complete: nothing may follow, not even the end token
                reason = "stop"
        if reason is not None:
            # The answer ends as decode() has it, less a character cut short (answer_text)
            piece = answer_text(self.tokenizer, seq.ids)[len(seq.text) :]
        if piece:
            # A stop string first seen now ends in the new piece: search only the tail it can start in.
            start = max(0, len(seq.text) - max((len(s) for s in stops), default=1) + 1)
            seq.text += piece
            cut = min((i for s in stops if (i := seq.text.find(s, start)) >= 0), default=-1)
            if cut >= 0:
                seq.text, reason = seq.text[:cut], "stop"
        # Hold back what could still become a stop string.
        end = len(seq.text) if reason else len(seq.text) - max((len(s) - 1 for s in stops), default=0)
        delta = seq.text[seq.sent : max(end, seq.sent)]
        seq.sent = max(end, seq.sent)
        if reason is not None:
            seq.emit(Event(delta, reason, len(seq.req.prompt_ids), len(seq.ids), cached_tokens=seq.cached))
            if self.observer is not None:
                self.observer.finished(len(seq.req.prompt_ids), len(seq.ids))
        elif delta:
            seq.emit(Event(delta))
        return reason is not None


@dataclass
class _Layer:
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class _Row:
    """One prompt's keys and values so far, (1, kv heads, tokens, head dim) per layer: what a cache's ``layers`` give."""

    layers: list[_Layer]


def _row(cache, held_at: int, held: int, new_at: int, count: int, past: int) -> _Row:
    """One prompt of a packed prefill from its ``cache``: the ``held`` columns it held from ``held_at`` among the
    ``past`` columns given before the forward, then its ``count`` new ones from ``new_at`` after them."""
    return _Row([_Layer(*(engine_attention.prompt_columns(t, held_at, held, past + new_at, count)
                          for t in (layer.keys, layer.values))) for layer in cache.layers])  # fmt: skip


def _top_p_sample(logits: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    """Sample one id from ``logits`` (vocab,) keeping the smallest set of ids whose probability reaches ``top_p``."""
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    sorted_probs[outside] = 0
    pick = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[pick])


def answer_text(tokenizer, ids: list[int]) -> str:
    """Generated ``ids`` as text: ``decode()``, less the bytes of a last character cut short (by ``max_tokens``):
    decode() shows them as U+FFFD, an incremental decoder holds them back, and vLLM's drops them too."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not text.endswith("\ufffd"):
        return text
    stream = DecodeStream(skip_special_tokens=True)
    held = [stream.step(tokenizer._tokenizer, token) for token in ids][-1] is None
    return text.rstrip("\ufffd") if held else text


def wait_for(engine: Engine, req: GenRequest, timeout_s: float = 600) -> Event:
    """Run ``req`` to completion from a plain thread; returns one event with the whole text (tests, benchmarks)."""
    return run_all(engine, [req], timeout_s)[0]


def run_all(engine: Engine, reqs: list[GenRequest], timeout_s: float = 600) -> list[Event]:
    """Run ``reqs`` to completion together from a plain thread; returns one event per request with its whole text.

    Raises:
        TimeoutError: some request had no final event after ``timeout_s``.
    """
    done = threading.Semaphore(0)
    parts: list[list[Event]] = [[] for _ in reqs]

    def listener(k: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            parts[k].append(event)
            if event.final:
                done.release()

        return emit

    for k, req in enumerate(reqs):
        engine.submit(req, listener(k))
    deadline = time.monotonic() + timeout_s
    for _ in reqs:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"no answer after {timeout_s:.0f} s")
    return [joined(p) for p in parts]


def on_passing_thread(fn: Callable[[], T], threads: int) -> T:
    """``fn()`` run with ``threads`` torch intra-op threads on a thread that ends when it returns; its result or error.

    Load and quantise a model this way in a process whose engine then decodes on its own thread. GNU OpenMP gives each
    thread that starts a parallel region a pool of workers of its own for as long as that thread lives; once a process
    has had two such threads (its main thread loading the model, the engine's thread decoding), the engine's parallel
    regions ran 1.3-1.6x slower (libgomp then spins far less before sleeping, as it does when its threads outnumber the
    CPUs). Measured on 2 cores, SmolLM2 W8A8, 64 requests at batch 16: loaded on the main thread, 165 generated tokens/s
    with 1 engine thread and 134 with 2; loaded on a passing thread, 218 with 2.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="raylora-load") as pool:
        return pool.submit(_with_threads, fn, threads).result()  # leaving the block ends the thread


def _with_threads(fn: Callable[[], T], threads: int) -> T:
    torch.set_num_threads(threads)
    return fn()


def answer_all(model, tokenizer, reqs: list[GenRequest], autocast=contextlib.nullcontext) -> list[Event]:
    """``reqs`` answered by a fresh engine over ``model``, stopped after (the quickstart's before and after answers)."""
    engine = Engine(model, tokenizer, max(1, len(reqs)), 0, autocast=autocast)
    try:
        return run_all(engine, reqs)
    finally:
        engine.stop()
