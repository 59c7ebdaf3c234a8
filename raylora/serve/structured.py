"""Structured outputs: answers held to a JSON schema (``response_format``) or to calls of declared tools
(``tool_choice`` ``required`` or a named function), by masking each constrained request's logits in the engine.

A request's constraint is an llguidance grammar (llguidance: no dependencies beyond its own wheel, what vLLM's
``guidance`` backend and llama.cpp use; xgrammar, the other library vLLM uses, pulls triton into a CPU install). The
replica compiles each grammar once (:class:`Grammars`, an LRU of compiled matchers) and gives each request its own
copy; the engine asks it, per decode step, which tokens may come next (:class:`Constraint`). Tool calls are written
in the Hermes format the chat templates teach (:mod:`raylora.serve.tools`), so a forced call parses as one.
"""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.hf
import torch

from raylora.serve.protocol import ApiError
from raylora.serve.tools import CLOSE, OPEN

# How JSON is written: compact but spaced as templates and people write it ({"a": 1, "b": 2}); no free whitespace,
# so a small model cannot stall in a run of blanks and every answer reads the same.
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_BITS = torch.arange(8, dtype=torch.uint8)
# A function without `parameters` takes none (OpenAI's reading): its arguments are {}.
NONE = {"type": "object", "properties": {}, "additionalProperties": False}


def grammar(response_format: dict | None, tools: list[dict] | None, tool_choice: str, tool_name: str | None,
            parallel_tool_calls: bool) -> str | None:  # fmt: skip
    """The llguidance grammar a request's answer must follow, or ``None`` when it is free.

    A forced ``tool_choice`` makes the answer calls only: ``required`` one or more calls of the declared tools (one
    with ``parallel_tool_calls: false``), a named function one call of it, the arguments valid against each tool's
    ``parameters``. Otherwise ``response_format`` ``json_object`` or ``json_schema`` makes it that JSON; with tools
    and ``tool_choice: auto`` beside it, the answer is that JSON or calls.
    """
    if tool_choice in ("required", "function"):
        chosen = [t for t in tools or [] if tool_choice == "required" or t["function"]["name"] == tool_name]
        return "start: calls\n" + _calls(chosen, parallel_tool_calls and tool_choice == "required")
    schema = _schema_of(response_format)
    if schema is None:
        return None
    if tool_choice == "auto" and tools:
        return f"start: answer | calls\nanswer: %json {_json(schema)}\n" + _calls(tools, parallel_tool_calls)
    return f"start: %json {_json(schema)}\n"


def _schema_of(response_format: dict | None) -> dict | None:
    if response_format is None or response_format["type"] == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]  # protocol fills in an absent schema


def _calls(tools: list[dict], many: bool) -> str:
    """Lark rules ``calls``: Hermes calls ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` of
    ``tools`` (one, or ``many`` on lines of their own), the arguments valid against each tool's ``parameters``."""
    one = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"].get("parameters", NONE)},
        "required": ["name", "arguments"], "additionalProperties": False,
    } for t in tools]}  # fmt: skip
    more = f" ({json.dumps(chr(10))} call)*" if many else ""
    return f"calls: call{more}\ncall: {json.dumps(OPEN + chr(10))} %json {_json(one)} {json.dumps(chr(10) + CLOSE)}\n"


def _json(schema: dict) -> str:
    """A schema as Lark's ``%json`` reads it, in :data:`JSON_STYLE`."""
    return json.dumps({**schema, "x-guidance": JSON_STYLE})


class Grammars:
    """One replica's compiled grammars: the tokenizer as llguidance reads it (about a second to build, once) and an
    LRU of compiled matchers, each copied per request.

    Args:
        tokenizer: the model's fast tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_ids: the ids that end an answer.
        cached: compiled grammars kept.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], cached: int = 64):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._compiled = functools.lru_cache(maxsize=cached)(self._compile)

    def _compile(self, text: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ApiError(400, f"the answer's structure cannot be enforced: {matcher.get_error()}",
                           "response_format", "unsupported_schema")  # fmt: skip
        return matcher

    def start(self, text: str) -> Constraint:
        """A fresh constraint for one request following grammar ``text`` (compiled on first use).

        Raises:
            ApiError: 400 when llguidance cannot enforce the grammar (a keyword it does not implement, say).
        """
        return Constraint(self._compiled(text).deep_copy(), self.vocab_size)


class Constraint:
    """One request's place in its grammar: which tokens may come next, and whether the answer is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits (``(vocab,)``, in place) of every token the grammar forbids next to ``-inf``."""
        self.matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        allowed = ((self._words.view(torch.uint8)[:, None] >> _BITS) & 1).flatten()[: logits.shape[-1]]
        logits.masked_fill_(allowed == 0, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (an end-of-sequence id too); a token the grammar refuses sets :attr:`error`."""
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """Whether the grammar takes nothing more: the answer is complete unless :attr:`error` says otherwise."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (a refused token, a parser limit), or ``None``."""
        if self.matcher.is_error():
            return f"the answer's grammar failed: {self.matcher.get_error()}"
        reason = self.matcher.stop_reason()
        if reason in ("NotStopped", "NoExtension", "NoExtensionBias", "EndOfSentence"):
            return None
        return f"the answer's grammar stopped: {reason}"
