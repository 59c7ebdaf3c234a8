"""Alpaca rows (``instruction``, ``input``, ``output``, optional ``system`` and ``history``) as chat messages."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Message = dict[str, str]
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


class RowError(ValueError):
    """A data row that cannot be used; the message is the reason written to the rejects file."""


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_or_index, row)`` from a JSON array file or a JSONL file.

    Raises:
        ValueError: the file is neither, naming the first offending line.
    """
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON at line {e.lineno}: {e.msg}") from None
        yield from enumerate(rows, start=1)
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON Lines ({e.msg}): {line[:120]!r}") from None


def to_messages(row: Any, placeholders: dict[str, str]) -> list[Message]:
    """Normalise one alpaca row to ``[{"role", "content"}, ...]`` with ``{{key}}`` placeholders filled.

    Raises:
        RowError: missing or non-string fields, an empty response, an unfilled placeholder.
    """
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    for key in ("instruction", "output"):
        if not isinstance(row.get(key), str):
            raise RowError(f"field {key!r} is missing or not a string")
    if not row["output"].strip():
        raise RowError("empty response ('output')")
    messages: list[Message] = []
    if isinstance(row.get("system"), str) and row["system"].strip():
        messages.append({"role": "system", "content": row["system"]})
    for turn in row.get("history") or []:
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise RowError("'history' must be a list of [prompt, response] string pairs")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise RowError("field 'input' is not a string")
    prompt = f"{row['instruction']}\n\n{extra}" if extra.strip() else row["instruction"]
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    return [{"role": m["role"], "content": fill(m["content"], placeholders)} for m in messages]


def fill(text: str, placeholders: dict[str, str]) -> str:
    """Replace ``{{key}}`` with ``placeholders[key]``; an unknown key is a :class:`RowError`."""

    def sub(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in placeholders:
            raise RowError(f"placeholder {{{{{key}}}}} has no value; set data.placeholders.{key}")
        return placeholders[key]

    return _PLACEHOLDER.sub(sub, text)
