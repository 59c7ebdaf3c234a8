"""Preference rows normalised to pairs: one prompt, a chosen and a rejected answer (DPO, SimPO, ORPO); and KTO's
unpaired rows: one prompt, one answer and whether it is desirable.

Each row is read by its keys, in the shapes their tools write:

- LLaMA-Factory's ranking data (``ranking: true``): alpaca rows with ``chosen`` / ``rejected`` strings, and
  sharegpt rows whose ``conversations`` stop before the answer, ``chosen`` / ``rejected`` being turns;
- LLaMA-Factory v1: ``chosen_messages`` / ``rejected_messages``, each the whole conversation (content parts,
  ``loss_weight``), the prompt being the turns they share;
- TRL: ``prompt`` / ``chosen`` / ``rejected`` as strings (a user turn and the assistant's answers) or as message
  lists, or ``chosen`` / ``rejected`` lists alone, the prompt being the turns they share (TRL's implicit prompt);
- OpenAI's preference fine-tuning: ``input`` (``messages``, ``tools``), ``preferred_output``,
  ``non_preferred_output``.

KTO's rows are LLaMA-Factory's alpaca, sharegpt or openai rows with a boolean ``kto_tag`` (the name
``columns.kto_tag`` maps), or TRL's unpaired rows: ``prompt`` / ``completion`` (strings, or message lists) and a boolean
``label``; the answer is what follows the last user turn.

Tools, tool calls and reasoning parts are read as :mod:`raylora.data.formats` reads them for one answer. In a
pair the prompt is never learned and the answers' assistant turns always are, whatever their ``loss_weight``:
the objectives compare the log-probabilities of the two answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylora.config import DataArgs
from raylora.data.formats import (
    DEFAULT_COLUMNS,
    PAIR_COLUMNS,
    Conversation,
    Message,
    RowError,
    alpaca_messages,
    fill_all,
    fill_messages,
    openai_messages,
    parse_tools,
    sharegpt_messages,
    string_field,
    to_conversation,
)

UNPAIRED = (
    "an unpaired preference row (one answer with a true / false label or kto_tag, KTO's data): train.objective: kto "
    "fits this file"
)
UNLABELLED = (
    "a row without a true / false label, but train.objective is kto, which learns from answers labelled desirable or "
    "not: give each row a boolean kto_tag (LLaMA-Factory; columns.kto_tag names another field) or label (TRL); "
    "a chosen / rejected pair trains with train.objective: dpo"
)
KTO_COLUMNS = {"kto_tag": "kto_tag"}
NOT_SHARED = "the chosen and rejected conversations differ before the assistant's answer: they share no prompt"
NO_TEXT_PROMPT = (
    "plain-text chosen / rejected answers without a prompt (TRL's implicit prompt in text): pairs are rendered with "
    "the chat template, which needs the prompt apart; give a prompt field, or chosen / rejected as message lists"
)
_OPENAI = DEFAULT_COLUMNS["openai"]


@dataclass
class Pair:
    """One preference row, normalised: the prompt both answers follow, each answer (from an assistant turn on) and
    the function schemas the prompt shows (``tools``, or None)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass
class Unpaired:
    """One KTO row, normalised: the prompt, the answer (from an assistant turn on), whether the answer is desirable
    and the function schemas the prompt shows (``tools``, or None)."""

    prompt: list[Message]
    answer: list[Message]
    desirable: bool
    tools: list[dict[str, Any]] | None = None


def conversations(pair: Pair) -> tuple[Conversation, Conversation]:
    """The prompt followed by the chosen answer, and the prompt followed by the rejected one."""
    return Conversation(pair.prompt + pair.chosen, pair.tools), Conversation(pair.prompt + pair.rejected, pair.tools)


def label_of(row: Any, columns: dict[str, str] | None = None) -> bool | None:
    """A KTO row's label: its boolean ``kto_tag`` (or the field ``columns`` maps it to) or ``label``; else None."""
    if not isinstance(row, dict):
        return None
    for key in ((columns or {}).get("kto_tag", "kto_tag"), "label"):
        if isinstance(row.get(key), bool):
            return row[key]
    return None


def is_unpaired(row: Any, columns: dict[str, str] | None = None) -> bool:
    """Whether a row is KTO's: one answer judged by a boolean (LLaMA-Factory's ``kto_tag``, TRL's ``label``)."""
    return label_of(row, columns) is not None


def pair_format(row: Any) -> str | None:
    """The format a preference row reads as, by its keys, or ``None`` (for one answer per row:
    :func:`~raylora.data.formats.detect_format`)."""
    if not isinstance(row, dict):
        return None
    if any(key in row for key in ("chosen_messages", "preferred_output", "messages")):
        return "openai"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row or isinstance(row.get("chosen"), str):
        return "alpaca"
    return "openai" if isinstance(row.get("chosen"), (list, dict)) else None


def fits(row: dict, fmt: str, columns: dict[str, str]) -> bool:
    """Whether a preference row holds a field format ``fmt`` reads its prompt from (a declared format, checked on a
    file's first row)."""
    names = {**DEFAULT_COLUMNS[fmt], **PAIR_COLUMNS, **columns}
    if fmt == "alpaca":
        return names["instruction"] in row or "prompt" in row
    if fmt == "sharegpt":
        return names["messages"] in row
    if fmt == "openai":
        keys = (names["messages"], "prompt", "input", "chosen_messages")
        return any(key in row for key in keys) or isinstance(row.get(names["chosen"]), list)
    return False


def read_row(row: Any, how: dict[str, Any], data: DataArgs) -> Conversation | Pair | Unpaired:
    """One parsed row as its file's plan entry (:func:`~raylora.data.sources.plan_sources`) reads it: a
    :class:`Pair` from a preference file, an :class:`Unpaired` from KTO's, else a :class:`~raylora.data.formats.Conversation`.

    Raises:
        RowError: the row cannot be used; the message says why.
    """
    if how.get("pairs"):
        return to_pair(row, how["format"], how["columns"], data.placeholders, data.drop_reasoning)
    if how.get("unpaired"):
        return to_unpaired(row, how["format"], how["columns"], data.placeholders, data.drop_reasoning)
    return to_conversation(
        row, how["format"], how["columns"], data.placeholders, data.mask_history, data.drop_reasoning
    )


def to_pair(
    row: Any, fmt: str, columns: dict[str, str], placeholders: dict[str, str], drop_reasoning: bool = False
) -> Pair:
    """Normalise one preference row of format ``fmt`` with ``{{key}}`` placeholders filled.

    Args:
        row: the parsed row.
        fmt: ``alpaca``, ``sharegpt`` or ``openai`` (how a prompt beside ``chosen`` / ``rejected`` is read; the v1
            and OpenAI shapes are known by their keys in any).
        columns: overrides of :data:`~raylora.data.formats.DEFAULT_COLUMNS` and ``chosen`` / ``rejected``.
        placeholders: values for ``{{key}}``.
        drop_reasoning: leave reasoning traces out.
    Raises:
        RowError: a field missing or mistyped (as for one answer), an unpaired (KTO) row, an answer that is empty
            or does not start with an assistant turn, identical answers, conversations that share no prompt.
    """
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    if is_unpaired(row):
        raise RowError(UNPAIRED)
    names = {**DEFAULT_COLUMNS[fmt], **PAIR_COLUMNS, **columns}
    tools, tools_name = row.get(names["tools"]), names["tools"]
    if "preferred_output" in row:
        source = row.get("input")
        if not isinstance(source, dict):
            raise RowError("field 'input' is missing or not an object; OpenAI's preference rows hold input.messages")
        prompt = openai_messages(source, _OPENAI)
        chosen = openai_messages(row, {**_OPENAI, "messages": "preferred_output"})
        rejected = openai_messages(row, {**_OPENAI, "messages": "non_preferred_output"})
        tools, tools_name = source.get("tools"), "input.tools"
    elif "chosen_messages" in row:
        whole = [openai_messages(row, {**_OPENAI, "messages": key}) for key in ("chosen_messages", "rejected_messages")]
        prompt, chosen, rejected = _split(*whole)
    elif fmt == "alpaca":
        prompt, chosen, rejected = _alpaca_pair(row, names)
    elif fmt == "sharegpt":
        prompt = sharegpt_messages(row, names)
        chosen, rejected = (
            sharegpt_messages({names["messages"]: _answer_turns(row, names[k])}, names) for k in PAIR_COLUMNS
        )
    else:
        prompt, chosen, rejected = _chat_pair(row, names)
    return _pair(prompt, chosen, rejected, parse_tools(tools, tools_name), placeholders, drop_reasoning)


def _pair(
    prompt: list[Message],
    chosen: list[Message],
    rejected: list[Message],
    tools: list[dict[str, Any]] | None,
    placeholders: dict[str, str],
    drop_reasoning: bool,
) -> Pair:
    """The checked pair: a prompt, two different answers that start with an assistant turn and say something."""
    if not prompt:
        raise RowError("no prompt: the chosen and rejected answers start the conversation")
    for messages in (prompt, chosen, rejected):
        fill_messages(messages, placeholders, drop_reasoning)
    prompt = [{**m, "loss_weight": 0.0} if m["role"] == "assistant" or m.get("loss_weight") else m for m in prompt]
    chosen, rejected = ([{k: v for k, v in m.items() if k != "loss_weight"} for m in a] for a in (chosen, rejected))
    if chosen == rejected:
        raise RowError("the chosen and rejected answers are identical")
    for which, answer in (("chosen", chosen), ("rejected", rejected)):
        if answer and answer[0]["role"] != "assistant":
            raise RowError(f"the {which} answer starts with a {answer[0]['role']} turn, not the assistant's")
        if all(not m["content"].strip() and not m.get("tool_calls") for m in answer if m["role"] == "assistant"):
            raise RowError(f"empty {which} answer")
    return Pair(prompt, chosen, rejected, fill_all(tools, placeholders))


def to_unpaired(
    row: Any, fmt: str, columns: dict[str, str], placeholders: dict[str, str], drop_reasoning: bool = False
) -> Unpaired:
    """Normalise one KTO row of format ``fmt`` (its rows' format without the label; TRL's ``prompt`` /
    ``completion`` rows are known by their keys) with ``{{key}}`` placeholders filled.

    Raises:
        RowError: no boolean label, a field missing or mistyped (as for one answer), no user turn, or no answer after
            the last one, an empty answer.
    """
    desirable = label_of(row, columns)
    if desirable is None:
        raise RowError("no boolean kto_tag or label: KTO needs each answer labelled desirable (true) or not (false)")
    names = {key: v for key, v in columns.items() if key not in KTO_COLUMNS}
    rest = {key: v for key, v in row.items() if key not in (columns.get("kto_tag", "kto_tag"), "label")}
    if "completion" in rest or (fmt == "openai" and "prompt" in rest):  # TRL's unpaired rows
        prompt = _trl_side(rest, "prompt", "user")
        answer = _trl_side(rest, "completion", "assistant")
        tools = fill_all(parse_tools(rest.get("tools"), "tools"), placeholders)
        for messages in (prompt, answer):
            fill_messages(messages, placeholders, drop_reasoning)
    else:
        conversation = to_conversation(rest, fmt, names, placeholders, False, drop_reasoning)
        users = [k for k, m in enumerate(conversation.messages) if m["role"] == "user"]
        if not users:
            raise RowError("no user turn: KTO's answer is what follows the last user turn")
        prompt, answer = conversation.messages[: users[-1] + 1], conversation.messages[users[-1] + 1 :]
        tools = conversation.tools
    prompt = [{**m, "loss_weight": 0.0} if m["role"] == "assistant" or m.get("loss_weight") else m for m in prompt]
    answer = [{k: v for k, v in m.items() if k != "loss_weight"} for m in answer]
    if not answer or answer[0]["role"] != "assistant":
        raise RowError("no assistant answer after the last user turn")
    if all(not m["content"].strip() and not m.get("tool_calls") for m in answer if m["role"] == "assistant"):
        raise RowError("empty answer")
    return Unpaired(prompt, answer, desirable, tools)


def _trl_side(row: dict, key: str, role: str) -> list[Message]:
    """TRL's ``prompt`` or ``completion``: a string (one ``role`` turn) or a message list."""
    value = row.get(key)
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"empty {key} ({key!r})")
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise RowError(f"field {key!r} is missing or not a string or a non-empty message list")
    return openai_messages({"messages": value}, _OPENAI)


def _alpaca_pair(row: dict, names: dict[str, str]) -> tuple[list[Message], list[Message], list[Message]]:
    if names["instruction"] not in row and "prompt" in row:
        names = {**names, "instruction": "prompt"}  # TRL's standard rows
    elif names["instruction"] not in row and isinstance(row.get(names["chosen"]), str):
        raise RowError(NO_TEXT_PROMPT)
    messages = alpaca_messages(row, {**names, "output": names["chosen"]})
    return messages[:-1], messages[-1:], [{"role": "assistant", "content": string_field(row, names["rejected"])}]


def _chat_pair(row: dict, names: dict[str, str]) -> tuple[list[Message], list[Message], list[Message]]:
    """TRL's conversational rows (explicit or implicit prompt), and LLaMA-Factory's openai-formatted ranking rows."""
    chosen, rejected = (openai_messages({names["messages"]: _answer_turns(row, names[k])}, names) for k in PAIR_COLUMNS)
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RowError("empty prompt ('prompt')")
            return [{"role": "user", "content": prompt}], chosen, rejected
        return openai_messages(row, {**names, "messages": "prompt"}), chosen, rejected
    if names["messages"] in row:
        return openai_messages(row, names), chosen, rejected
    return _split(chosen, rejected)


def _answer_turns(row: dict, key: str) -> list[Any]:
    """An answer's turns: a turn (LLaMA-Factory) or a list of them."""
    value = row.get(key)
    turns = [value] if isinstance(value, dict) else value
    if not isinstance(turns, list) or not turns:
        raise RowError(f"field {key!r} is missing or not a turn or a non-empty list of turns")
    return turns


def _split(chosen: list[Message], rejected: list[Message]) -> tuple[list[Message], list[Message], list[Message]]:
    """The turns two whole conversations share (the prompt), then each one's answer."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if any(k < len(m) and m[k]["role"] != "assistant" for m in (chosen, rejected)):
        raise RowError(NOT_SHARED)
    return chosen[:k], chosen[k:], rejected[k:]
