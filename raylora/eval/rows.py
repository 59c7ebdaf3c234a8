"""The eval set: prompts with their references, rendered and tokenised on the driver; what cannot be, rejected.

Rows come from ``eval.sources`` (every row) or, without them, from the held-out split of ``data.sources`` (the rows
``raylora prepare`` holds out). A row's prompt is its conversation up to its last assistant turn, rendered with the
chat template as serving renders it; the reference is that turn's text, or its tool calls (written as the Hermes
template writes them, for the text metrics). A row is rejected, with its reason, when it cannot be read, has no
assistant turn, the template refuses it, or its prompt and ``eval.max_tokens`` do not fit the model's context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from raylora.config import JobConfig
from raylora.data.encode import Encoder, tokenizer_spec
from raylora.data.formats import Conversation
from raylora.data.sources import read_conversations
from raylora.eval.metrics import row_keys
from raylora.templates import hermes_tool_call


@dataclass
class EvalRow:
    """One prompt of the eval set.

    Attributes:
        row: its index in the eval set.
        source: the file it came from (its name), for per-source scores.
        line: its line (or row) in that file.
        question: the last user turn's text, for reports.
        reference: the reference answer's text.
        calls: the reference's tool calls, or None.
        tools: the functions the prompt offers, or None.
        keys: the strings a correct answer holds (``eval.keys``, ``eval.key_pattern``).
        prompt_ids: the rendered prompt's token ids.
        answer_ids: the reference answer's token ids as the template writes them after the prompt (its end of turn
            included), or None when the template renders the prompt otherwise inside the whole conversation.
    """

    row: int
    source: str
    line: int
    question: str
    reference: str
    calls: list[dict] | None
    tools: list[dict] | None
    keys: list[str]
    prompt_ids: list[int]
    answer_ids: list[int] | None


def eval_rows(cfg: JobConfig, tokenizer, max_context: int) -> tuple[list[EvalRow], list[dict[str, Any]]]:
    """The eval set's rows and its rejects (``{"source", "line", "reason"}``), at most ``eval.max_rows`` rows."""
    held_out = not cfg.eval.sources
    data = cfg.data if held_out else dataclasses.replace(cfg.data, sources=cfg.eval.sources, max_samples=None)
    encoder = Encoder(tokenizer_spec(tokenizer, cfg.data.template), cfg.data.cutoff_len, "tail", False)
    rows: list[EvalRow] = []
    rejects: list[dict[str, Any]] = []
    # the held-out split is of the job's kind (a preference pair: its prompt, the chosen answer the reference); an
    # eval set of its own is read as conversations
    objective = cfg.train.objective if held_out else "sft"
    for path, line, conversation in read_conversations(data, held_out, objective):
        if cfg.eval.max_rows is not None and len(rows) == cfg.eval.max_rows:
            break
        source = Path(path).name
        reason = conversation if isinstance(conversation, str) else None
        if reason is None:
            made = _row(cfg, encoder, tokenizer, conversation, max_context)
            if isinstance(made, str):
                reason = made
            else:
                rows.append(dataclasses.replace(made, row=len(rows), source=source, line=line))
                continue
        rejects.append({"source": source, "line": line, "reason": reason})
    return rows, rejects


def _row(cfg: JobConfig, encoder: Encoder, tokenizer, conversation: Conversation, max_context: int) -> EvalRow | str:
    """One row, or the reason it cannot be scored."""
    messages = conversation.messages
    last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None or last == 0:
        return "no assistant turn after a prompt: nothing to compare an answer with"
    answer = messages[last]
    calls = answer.get("tool_calls") or None
    reference = "\n".join([answer["content"]] * bool(answer["content"]) + [hermes_tool_call(c) for c in calls or []])
    try:
        text = encoder.prompt(Conversation(messages[:last], conversation.tools))
    except TemplateError as e:
        return f"the chat template refuses the prompt: {e}"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    whole = tokenizer(encoder.text(Conversation(messages[: last + 1], conversation.tools)), add_special_tokens=False)
    answer_ids = whole.input_ids[len(ids) :] if whole.input_ids[: len(ids)] == ids else None
    if len(ids) + cfg.eval.max_tokens > max_context:
        return (f"the prompt has {len(ids)} tokens; with eval.max_tokens={cfg.eval.max_tokens} it passes the model's "
                f"context of {max_context} tokens")  # fmt: skip
    question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    keys = row_keys(reference, cfg.eval.keys, cfg.eval.key_pattern)
    return EvalRow(0, "", 0, question, reference, calls, conversation.tools, keys, ids, answer_ids or None)
