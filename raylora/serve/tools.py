"""Tool calls in a generated answer, read the way chat templates teach models to write them.

raylora's Hermes fallback (:mod:`raylora.templates`), and the Qwen2.5, Qwen3 and Hermes templates, write each
call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` after any text; Llama 3.x templates
write a call as the whole answer, a JSON object ``{"name": ..., "parameters": {...}}``. Calls come out in
OpenAI's shape (``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``); an answer that
holds no well-formed call stays text. A forced ``tool_choice`` (a call, or a call of one function) holds the
answer to calls in the Hermes format (:mod:`raylora.serve.structured`).
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)


def split_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of an answer: the text before its first call (None when blank) and its calls.

    Args:
        text: the generated answer.
        names: the request's function names; every call must name one of them (as OpenAI's calls do), so an
            answer that is JSON for the user (``{"name": "Ada", ...}``) stays text.
    Returns:
        ``(text, [])`` when the answer holds no call, or one that is not valid JSON naming a function of ``names``.
    """
    start = text.find(OPEN)
    if start >= 0:
        calls = [_call(block) for block in _BLOCK.findall(text, start)]
    else:
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        calls = [_call(item) for item in (value if isinstance(value, list) else [value])]
    if not (calls and all(c and c["function"]["name"] in names for c in calls)):
        return text, []
    return (text[:start] if start > 0 and text[:start].strip() else None), calls


def _call(block: str | object) -> dict | None:
    if isinstance(block, str):
        try:
            block = json.loads(block)
        except ValueError:
            return None
    if not (isinstance(block, dict) and isinstance(block.get("name"), str) and block["name"]):
        return None
    arguments = block.get("arguments", block.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    function = {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": function}


class CallStream:
    """A streamed answer split into text that can go out now and text held back because it may be a call.

    Text goes out as it comes until ``<tool_call>`` starts (a tail that could begin it waits for the next
    piece); an answer that opens with ``{`` or ``[`` is held whole, as it may be a bare JSON call. At the end,
    :meth:`finish` parses the whole answer as :func:`split_calls` does.
    """

    def __init__(self, names: set[str]):
        self.names, self.text, self.sent, self.held = names, "", 0, False

    def feed(self, piece: str) -> str:
        """Take the next generated piece; returns the text that can be sent now (maybe empty)."""
        self.text += piece
        if self.held or (self.sent == 0 and not self.text.strip()):  # once text went out, it is not blank
            return ""
        if self.sent == 0 and self.text.lstrip()[0] in "{[":
            self.held = True
            return ""
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.held = True
            return self._send(start)
        tail = next((k for k in range(len(OPEN) - 1, 0, -1) if self.text.endswith(OPEN[:k])), 0)
        return self._send(len(self.text) - tail)

    def finish(self) -> tuple[str, list[dict]]:
        """``(text still to send, calls)`` once the answer is complete."""
        content, calls = split_calls(self.text, self.names)
        if not calls:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, []
        return (self._send(len(content)) if content else ""), calls

    def _send(self, end: int) -> str:
        if self.sent == 0 and not self.text[:end].strip():  # blank so far: content is None if a call follows
            return ""
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out
