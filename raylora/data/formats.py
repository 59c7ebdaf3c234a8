"""Row formats normalised to one messages schema: ``[{"role", "content"}, ...]``.

Roles are ``system``, ``user``, ``assistant`` and ``tool`` (a tool's result); an assistant turn that
calls a tool carries the call as its content and is learned like any other assistant turn. Plain
text rows (continued pre-training) become a single ``text`` message.
"""

from __future__ import annotations

import re
from typing import Any

Message = dict[str, str]
FORMATS = ("alpaca", "sharegpt", "openai", "text")
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# A format's fields, and sharegpt's role tags, as LLaMA-Factory names them; data.sources[].columns maps
# any of these names to the file's own column or tag.
DEFAULT_COLUMNS = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system", "history": "history"},
    "sharegpt": {
        "messages": "conversations", "system": "system", "role_tag": "from", "content_tag": "value",
        "user_tag": "human", "assistant_tag": "gpt", "system_tag": "system",
        "function_tag": "function_call", "observation_tag": "observation",
    },
    "openai": {"messages": "messages", "role_tag": "role", "content_tag": "content"},
    "text": {"text": "text"},
}  # fmt: skip
_OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class RowError(ValueError):
    """A data row that cannot be used; the message is the reason written to the rejects file."""


def detect_format(row: Any) -> str | None:
    """The format a row looks like by its keys, or ``None``."""
    if isinstance(row, dict):
        for key, fmt in (
            ("conversations", "sharegpt"),
            ("messages", "openai"),
            ("instruction", "alpaca"),
            ("text", "text"),
        ):
            if key in row:
                return fmt
    return None


def to_messages(row: Any, fmt: str, columns: dict[str, str], placeholders: dict[str, str]) -> list[Message]:
    """Normalise one row of format ``fmt`` to messages with ``{{key}}`` placeholders filled.

    Args:
        row: the parsed row.
        fmt: one of :data:`FORMATS`.
        columns: overrides of :data:`DEFAULT_COLUMNS` for this format.
        placeholders: values for ``{{key}}``.
    Raises:
        RowError: missing or mistyped field, empty response, unknown role, unfilled placeholder.
    """
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    names = {**DEFAULT_COLUMNS[fmt], **columns}
    messages = {"alpaca": _alpaca, "sharegpt": _sharegpt, "openai": _openai, "text": _text}[fmt](row, names)
    if fmt != "text":
        if not any(m["role"] == "assistant" for m in messages):
            raise RowError("no assistant turn to learn from")
        if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
            raise RowError("empty response")
    return [{"role": m["role"], "content": fill(m["content"], placeholders)} for m in messages]


def fill(text: str, placeholders: dict[str, str]) -> str:
    """Replace ``{{key}}`` with ``placeholders[key]``; an unknown key is a :class:`RowError`."""

    def sub(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in placeholders:
            raise RowError(f"placeholder {{{{{key}}}}} has no value; set data.placeholders.{key}")
        return placeholders[key]

    return _PLACEHOLDER.sub(sub, text)


def _string(row: dict, name: str, required: bool = True) -> str:
    value = row.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RowError(f"field {name!r} is {'missing' if value is None else type(value).__name__}, expected a string")
    return value


def _alpaca(row: dict, names: dict[str, str]) -> list[Message]:
    messages: list[Message] = []
    system = _string(row, names["system"], required=False)
    if system.strip():
        messages.append({"role": "system", "content": system})
    history = row.get(names["history"]) or []
    if not isinstance(history, list):
        raise RowError(f"field {names['history']!r} must be a list of [prompt, response] pairs")
    for turn in history:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise RowError(f"field {names['history']!r} must be a list of [prompt, response] string pairs")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    instruction = _string(row, names["instruction"])
    extra = _string(row, names["input"], required=False)
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    if not prompt.strip():
        raise RowError(f"empty prompt ({names['instruction']!r})")
    return messages + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": _string(row, names["output"])},
    ]


def _turns(row: dict, names: dict[str, str]) -> list[Any]:
    turns = row.get(names["messages"])
    if not isinstance(turns, list) or not turns:
        raise RowError(f"field {names['messages']!r} is missing or not a non-empty list")
    if not all(isinstance(t, dict) for t in turns):
        raise RowError(f"every turn of {names['messages']!r} must be an object")
    return turns


def _sharegpt(row: dict, names: dict[str, str]) -> list[Message]:
    roles = {
        names["user_tag"]: "user", names["assistant_tag"]: "assistant", names["system_tag"]: "system",
        names["function_tag"]: "assistant", names["observation_tag"]: "tool",
    }  # fmt: skip
    messages: list[Message] = []
    system = _string(row, names["system"], required=False)
    if system.strip():
        messages.append({"role": "system", "content": system})
    for turn in _turns(row, names):
        tag = turn.get(names["role_tag"])
        if tag not in roles:
            raise RowError(
                f"unknown role {tag!r}; expected one of {', '.join(map(repr, roles))} (data.sources[].columns)"
            )
        messages.append({"role": roles[tag], "content": _string(turn, names["content_tag"])})
    return messages


def _openai(row: dict, names: dict[str, str]) -> list[Message]:
    messages: list[Message] = []
    for turn in _turns(row, names):
        role = turn.get(names["role_tag"])
        if role not in _OPENAI_ROLES:
            raise RowError(f"unknown role {role!r}; expected one of {', '.join(_OPENAI_ROLES)}")
        content = turn.get(names["content_tag"])
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise RowError("content parts must all be {'type': 'text', 'text': str}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RowError(f"content of a {role} turn is {type(content).__name__}, expected a string or text parts")
        messages.append({"role": _OPENAI_ROLES[role], "content": content})
    return messages


def _text(row: dict, names: dict[str, str]) -> list[Message]:
    text = _string(row, names["text"])
    if not text.strip():
        raise RowError("empty text")
    return [{"role": "text", "content": text}]
