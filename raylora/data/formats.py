"""Row formats normalised to one messages schema: ``[{"role", "content", ...}, ...]``.

Roles are ``system``, ``user``, ``assistant`` and ``tool`` (a tool's result). Every message has a string
``content``; some carry more, only when present:

- ``tool_calls`` (assistant): ``[{"type": "function", "function": {"name": str, "arguments": dict}}, ...]``,
  the shape chat templates that know tools read;
- ``reasoning`` (assistant): the reasoning trace before the answer;
- ``loss_weight``: 0 (not learned) or 1 (learned), given by the row (LLaMA-Factory's ``loss_weight``, or the
  ``weight`` of OpenAI fine-tuning and SlimOrca's sharegpt) or set by ``mask_history``; without it assistant turns are learned
  and the rest is not.

A conversation's function schemas travel beside its messages (:class:`Conversation`). Plain text rows
(continued pre-training) become a single ``text`` message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
FORMATS = ("alpaca", "sharegpt", "openai", "text")
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# A format's fields, and sharegpt's role tags, as LLaMA-Factory names them; data.sources[].columns maps
# any of these names to the file's own column or tag.
DEFAULT_COLUMNS = {
    "alpaca": {
        "instruction": "instruction", "input": "input", "output": "output", "system": "system", "history": "history",
        "tools": "tools", "mask_history": "mask_history",
    },
    "sharegpt": {
        "messages": "conversations", "system": "system", "tools": "tools", "mask_history": "mask_history",
        "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
        "system_tag": "system", "function_tag": "function_call", "observation_tag": "observation",
    },
    "openai": {
        "messages": "messages", "tools": "tools", "mask_history": "mask_history",
        "role_tag": "role", "content_tag": "content",
    },
    "text": {"text": "text"},
}  # fmt: skip
_OPENAI_ROLES = ("system", "user", "assistant", "tool")
TEXT_KEYS = ("text", "value")  # a content part's text, as OpenAI and LLaMA-Factory's v1 format name it
# A preference (ranking) row's answers, as LLaMA-Factory (v0) and TRL name them; data.sources[].columns may rename them.
PAIR_COLUMNS = {"chosen": "chosen", "rejected": "rejected"}
# The answers of LLaMA-Factory v1's pairs and of OpenAI's preference fine-tuning, under fixed names.
PAIR_KEYS = (("chosen_messages", "rejected_messages"), ("preferred_output", "non_preferred_output"))
PREFERENCE = (
    "a preference row (chosen / rejected answers), but train.objective is sft: set train.objective: dpo (or simpo / "
    "orpo) to train on the pairs; columns: {output: chosen} still trains SFT on the chosen answers"
)


@dataclass
class Conversation:
    """One row, normalised: its messages and the function schemas its prompt shows (``tools``, or None)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


def is_preference(row: Any, columns: dict[str, str]) -> bool:
    """Whether a row holds a chosen and a rejected answer: under :data:`PAIR_KEYS`, or under the names
    :data:`PAIR_COLUMNS` (as ``columns`` renames them) when no other ``columns`` entry maps them to a field (a
    dataset's chosen answers trained as plain answers map ``output: chosen``)."""
    if not isinstance(row, dict):
        return False
    if any(a in row and b in row for a, b in PAIR_KEYS):
        return True
    used = {v for k, v in columns.items() if k not in PAIR_COLUMNS}
    names = [columns.get(k, v) for k, v in PAIR_COLUMNS.items()]
    return all(name in row and name not in used for name in names)


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
    """The messages of :func:`to_conversation` (for callers that show a conversation rather than train on it)."""
    return to_conversation(row, fmt, columns, placeholders).messages


def to_conversation(
    row: Any,
    fmt: str,
    columns: dict[str, str],
    placeholders: dict[str, str],
    mask_history: bool = False,
    drop_reasoning: bool = False,
) -> Conversation:
    """Normalise one row of format ``fmt`` with ``{{key}}`` placeholders filled.

    Args:
        row: the parsed row.
        fmt: one of :data:`FORMATS`.
        columns: overrides of :data:`DEFAULT_COLUMNS` for this format.
        placeholders: values for ``{{key}}``.
        mask_history: learn only the last assistant turn, unless the row's own ``mask_history`` field says otherwise.
        drop_reasoning: leave reasoning traces out.
    Raises:
        RowError: missing or mistyped field, empty response, unknown role, unfilled placeholder, a tool call or
            tool list that is not valid, a content part that is neither text nor reasoning, a bad loss weight, a
            preference row (``chosen`` / ``rejected``).
    """
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    if is_preference(row, columns):
        raise RowError(PREFERENCE)
    names = {**DEFAULT_COLUMNS[fmt], **columns}
    messages = {"alpaca": alpaca_messages, "sharegpt": sharegpt_messages, "openai": openai_messages, "text": _text}[
        fmt
    ](row, names)
    if fmt == "text":
        return Conversation([{"role": "text", "content": fill(messages[0]["content"], placeholders)}])
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise RowError("no assistant turn to learn from")
    if any(not messages[i]["content"].strip() and not messages[i].get("tool_calls") for i in assistants):
        raise RowError("empty response")
    if _flag(row, names["mask_history"], mask_history):
        for i, m in enumerate(messages):
            if i != assistants[-1] and (m["role"] == "assistant" or "loss_weight" in m):
                m["loss_weight"] = 0.0
    fill_messages(messages, placeholders, drop_reasoning)
    return Conversation(messages, fill_all(parse_tools(row.get(names["tools"]), names["tools"]), placeholders))


def fill_messages(messages: list[Message], placeholders: dict[str, str], drop_reasoning: bool) -> None:
    """Fill ``{{key}}`` placeholders in the messages' text, reasoning and tool calls, in place; with
    ``drop_reasoning``, remove their reasoning instead."""
    for m in messages:
        m["content"] = fill(m["content"], placeholders)
        if "reasoning" in m:
            if drop_reasoning:
                del m["reasoning"]
            else:
                m["reasoning"] = fill(m["reasoning"], placeholders)
        if "tool_calls" in m:
            m["tool_calls"] = fill_all(m["tool_calls"], placeholders)


def fill_all(value: Any, placeholders: dict[str, str]) -> Any:
    """:func:`fill` on every string inside ``value`` (tool-call arguments, tool schemas)."""
    if isinstance(value, str):
        return fill(value, placeholders)
    if isinstance(value, dict):
        return {k: fill_all(v, placeholders) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_all(v, placeholders) for v in value]
    return value


def fill(text: str, placeholders: dict[str, str]) -> str:
    """Replace ``{{key}}`` with ``placeholders[key]``; an unknown key is a :class:`RowError`."""
    if "{{" not in text:
        return text

    def sub(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in placeholders:
            raise RowError(f"placeholder {{{{{key}}}}} has no value; set data.placeholders.{key}")
        return placeholders[key]

    return _PLACEHOLDER.sub(sub, text)


def parse_tools(value: Any, name: str = "tools") -> list[dict[str, Any]] | None:
    """A row's function schemas as OpenAI tools ``[{"type": "function", "function": {...}}]``, or None.

    ``value`` is a list, or its JSON text; each schema is OpenAI's or glaive's flat ``{name, description,
    parameters}``. Nothing (None, ``""``, ``[]``) gives None.
    Raises:
        RowError: not valid JSON, not a list, or a schema without a name.
    """
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"field {name!r} is not valid JSON ({e.msg}); expected a list of function schemas") from None
    if not isinstance(value, list):
        raise RowError(f"field {name!r} is a {type(value).__name__}, expected a list of function schemas")
    tools = []
    for k, tool in enumerate(value):
        schema = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else tool
        if not (isinstance(schema, dict) and isinstance(schema.get("name"), str) and schema["name"]):
            raise RowError(
                f"{name}[{k}] is not a function schema: expected {{type: function, function: {{name, description, "
                "parameters}} or {name, description, parameters}"
            )
        if not isinstance(schema.get("parameters", {}), dict):
            raise RowError(f"{name}[{k}] ({schema['name']}): parameters must be an object (a JSON schema)")
        tools.append({"type": "function", "function": schema})
    return tools


def parse_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls (a call or a list of calls, or their JSON text) as ``[{"type": "function", "function": {...}}]``.

    A call is ``{name, arguments}`` or OpenAI's ``{type: function, function: {name, arguments}}``; arguments
    are an object or its JSON text.
    Raises:
        RowError: not valid JSON, no name, or arguments that are not an object.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"{where} is not valid JSON ({e.msg}): {value[:80]!r}") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise RowError(f"{where} holds no call")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise RowError(f"{where} is not a tool call: expected {{name, arguments}}, got {json.dumps(call)[:80]}")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise RowError(f"{where}: the arguments of {fn['name']} are not valid JSON ({e.msg})") from None
        if not isinstance(arguments, dict):
            raise RowError(f"{where}: the arguments of {fn['name']} must be an object, got {type(arguments).__name__}")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _flag(row: dict, name: str, default: bool) -> bool:
    value = row.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RowError(f"field {name!r} is {type(value).__name__}, expected true or false")
    return value


def string_field(row: dict, name: str, required: bool = True) -> str:
    """``row[name]``, a string (``""`` when absent and not ``required``); else a :class:`RowError` naming the field."""
    value = row.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RowError(f"field {name!r} is {'missing' if value is None else type(value).__name__}, expected a string")
    return value


def _loss_weight(turn: dict, message: Message, k: int) -> Message:
    """The turn's ``loss_weight`` (LLaMA-Factory), or its ``weight`` (OpenAI fine-tuning, SlimOrca's sharegpt)."""
    weight = turn.get("loss_weight")
    if turn.get("weight") is not None:
        if weight is not None and weight != turn["weight"]:
            raise RowError(f"turn {k}: weight {turn['weight']!r} and loss_weight {weight!r} disagree")
        weight = turn["weight"]
    if weight is None:
        return message
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
        raise RowError(f"turn {k}: loss_weight must be a number in [0, 1], got {weight!r}")
    if weight not in (0, 1):
        raise RowError(
            f"turn {k}: loss_weight {weight} is between 0 and 1; only 0 (not learned) and 1 (learned) are supported"
        )
    return {**message, "loss_weight": float(weight)}


def alpaca_messages(row: dict, names: dict[str, str]) -> list[Message]:
    """An alpaca row's messages (fields named by ``names``): system, history, the prompt and its answer."""
    messages: list[Message] = []
    system = string_field(row, names["system"], required=False)
    if system.strip():
        messages.append({"role": "system", "content": system})
    history = row.get(names["history"]) or []
    if not isinstance(history, list):
        raise RowError(f"field {names['history']!r} must be a list of [prompt, response] pairs")
    for turn in history:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise RowError(f"field {names['history']!r} must be a list of [prompt, response] string pairs")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    instruction = string_field(row, names["instruction"])
    extra = string_field(row, names["input"], required=False)
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    if not prompt.strip():
        raise RowError(f"empty prompt ({names['instruction']!r})")
    return messages + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": string_field(row, names["output"])},
    ]


def _turns(row: dict, names: dict[str, str]) -> list[Any]:
    turns = row.get(names["messages"])
    if not isinstance(turns, list) or not turns:
        raise RowError(f"field {names['messages']!r} is missing or not a non-empty list")
    if not all(isinstance(t, dict) for t in turns):
        raise RowError(f"every turn of {names['messages']!r} must be an object")
    return turns


def sharegpt_messages(row: dict, names: dict[str, str]) -> list[Message]:
    """A sharegpt row's messages (fields and role tags named by ``names``), its system column first."""
    roles = {
        names["user_tag"]: "user", names["assistant_tag"]: "assistant", names["system_tag"]: "system",
        names["function_tag"]: "assistant", names["observation_tag"]: "tool",
    }  # fmt: skip
    messages: list[Message] = []
    system = string_field(row, names["system"], required=False)
    if system.strip():
        messages.append({"role": "system", "content": system})
    for k, turn in enumerate(_turns(row, names)):
        tag = turn.get(names["role_tag"])
        if tag not in roles:
            raise RowError(
                f"unknown role {tag!r}; expected one of {', '.join(map(repr, roles))} (data.sources[].columns)"
            )
        content = string_field(turn, names["content_tag"])
        if tag == names["function_tag"]:
            calls = parse_tool_calls(content, f"the {tag} turn {k}")
            message: Message = {"role": "assistant", "content": "", "tool_calls": calls}
        else:
            message = {"role": roles[tag], "content": content}
        messages.append(_loss_weight(turn, message, k))
    if len(messages) > 1 and messages[0]["role"] == messages[1]["role"] == "system" and system.strip():
        del messages[0]  # a system turn first wins over the system column, as in LLaMA-Factory's sharegpt reader
    return messages


def openai_messages(row: dict, names: dict[str, str]) -> list[Message]:
    """An openai row's messages (``names["messages"]``): roles, content parts, tool calls, reasoning, loss weights."""
    messages: list[Message] = []
    for k, turn in enumerate(_turns(row, names)):
        role = turn.get(names["role_tag"])
        role = "system" if role == "developer" else role  # OpenAI's newer name for system
        if role not in _OPENAI_ROLES:
            raise RowError(f"unknown role {role!r}; expected one of {', '.join(_OPENAI_ROLES)}")
        message = _parts(role, turn.get(names["content_tag"]), k)
        if turn.get("tool_calls"):
            if role != "assistant":
                raise RowError(f"turn {k}: a {role} turn has tool_calls; only assistant turns call tools")
            message["tool_calls"] = message.get("tool_calls", []) + parse_tool_calls(
                turn["tool_calls"], f"the tool_calls of turn {k}"
            )
        reasoning = turn.get("reasoning_content")
        if reasoning is not None:
            if role != "assistant" or not isinstance(reasoning, str):
                raise RowError(f"turn {k}: reasoning_content must be a string on an assistant turn")
            message["reasoning"] = reasoning + message.get("reasoning", "")
        messages.append(_loss_weight(turn, message, k))
    return messages


def _parts(role: str, content: Any, k: int) -> Message:
    """A turn's content, a string or a list of parts: text (``text`` or ``value``), reasoning, tool calls."""
    if isinstance(content, str):
        return {"role": role, "content": content}
    if content is None and role == "assistant":
        return {"role": role, "content": ""}  # OpenAI's assistant turn that only calls tools
    if not isinstance(content, list):
        raise RowError(f"content of a {role} turn is {type(content).__name__}, expected a string or a list of parts")
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            raise RowError(f"turn {k}: a content part is a {type(part).__name__}, expected an object with a type")
        kind = part.get("type")
        value = next((part[key] for key in TEXT_KEYS if isinstance(part.get(key), str)), None)
        if kind == "text" and value is not None:
            text.append(value)
        elif kind == "reasoning" and value is not None and role == "assistant":
            reasoning.append(value)
        elif kind == "tool_call" and value is not None and role == "assistant":
            calls += parse_tool_calls(value, f"a tool_call part of turn {k}")
        elif kind in ("text", "reasoning", "tool_call") and value is not None:
            raise RowError(f"turn {k}: a {role} turn has a {kind} part; only assistant turns carry {kind} parts")
        elif kind in ("text", "reasoning", "tool_call"):
            raise RowError(f"turn {k}: a {kind} part has no string 'text' or 'value'")
        else:
            raise RowError(
                f"turn {k}: content part type {kind!r} is not supported; parts must be text, reasoning or tool_call"
            )
    message: Message = {"role": role, "content": "".join(text)}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _text(row: dict, names: dict[str, str]) -> list[Message]:
    text = string_field(row, names["text"])
    if not text.strip():
        raise RowError("empty text")
    return [{"role": "text", "content": text}]
