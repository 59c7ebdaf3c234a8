"""Scores of one answer against its reference, and their means per candidate and per source.

ROUGE-1/2/L and BLEU-4 are computed as LLaMA-Factory's ``do_predict`` reports them (``ComputeSimilarity`` and
``scripts/eval_bleu_rouge.py``), so that the numbers compare: both texts cut into words by ``jieba``, ROUGE F1 from
``rouge-chinese`` on the space-joined words (0 when either text has no word), BLEU-4 from NLTK's ``sentence_bleu`` on
characters with smoothing method 3, each times 100 and rounded to 4 places. ``rouge-score``'s default tokenizer drops
Chinese characters, which is why it is not used.

A row's value of a metric is ``None`` where the metric does not apply (``contains`` for a row without keys; the
tool metrics for a row whose reference calls no tool); means skip those rows and count the rows they cover.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from typing import Any

import jieba
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
from rouge_chinese import Rouge

from raylora.config import METRICS
from raylora.serve.tools import OPEN, split_calls

jieba.setLogLevel(logging.CRITICAL)
_CALL_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:</tool_call>|\Z)", re.S)


def normalise(text: str) -> str:
    """Case-folded, with runs of whitespace as one space and none at the ends."""
    return " ".join(text.split()).casefold()


def similarity(answer: str, reference: str) -> dict[str, float]:
    """``rouge-1``, ``rouge-2``, ``rouge-l`` and ``bleu-4`` of ``answer`` against ``reference``, 0-100, as
    LLaMA-Factory computes them."""
    hypothesis, words = list(jieba.cut(answer)), list(jieba.cut(reference))
    if not " ".join(hypothesis).split() or not " ".join(words).split():
        rouge = {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0}
    else:
        scores = Rouge().get_scores(" ".join(hypothesis), " ".join(words))[0]
        rouge = {k: round(v["f"] * 100, 4) for k, v in scores.items()}
    bleu = sentence_bleu([list(reference)], list(answer), smoothing_function=SmoothingFunction().method3)
    return {**rouge, "bleu-4": round(bleu * 100, 4)}


def row_keys(reference: str, keys: list[str], pattern: str | None) -> list[str]:
    """The key strings of one row: those of ``keys`` its reference holds (case-insensitive), and ``pattern``'s
    matches in it."""
    found = [k for k in keys if k and k.casefold() in reference.casefold()]
    if pattern:
        found += [m.group(0) for m in re.finditer(pattern, reference) if m.group(0)]
    return list(dict.fromkeys(found))


def _answer_calls(answer: str, names: set[str]) -> tuple[list[dict], bool]:
    """The calls an answer makes (``[{"name", "arguments": dict}]``) and whether every call it writes is JSON."""
    blocks = _CALL_BLOCK.findall(answer) if OPEN in answer else [answer.strip()]
    valid = True
    for block in blocks:
        try:
            json.loads(block)
        except ValueError:
            valid = False
    _, calls = split_calls(answer, names)
    parsed = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]
    return parsed, valid and bool(blocks)


def score_row(answer: str, reference: str, calls: list[dict] | None, tools: list[dict] | None, keys: list[str],
              completion_tokens: int, metrics: list[str]) -> dict[str, float | None]:  # fmt: skip
    """The ``metrics`` of one answer.

    Args:
        answer: the generated text.
        reference: the reference answer's text (for a tool-calling reference, its calls as the template writes them).
        calls: the reference's tool calls (``[{"type": "function", "function": {"name", "arguments": dict}}]``), or
            None for a text answer.
        tools: the function schemas the prompt offered (their names are what an answer may call).
        keys: the row's key strings (:func:`row_keys`).
        completion_tokens: the answer's length in tokens.
    Returns:
        ``{metric: value}``: 0/1 for exact_match, contains, tool_name, tool_args and tool_json, 0-100 for ROUGE and
        BLEU, tokens for length; None where a metric does not apply to the row.
    """
    out: dict[str, float | None] = {}
    if "exact_match" in metrics:
        out["exact_match"] = float(normalise(answer) == normalise(reference))
    if "contains" in metrics:
        out["contains"] = float(all(k.casefold() in answer.casefold() for k in keys)) if keys else None
    if any(m in metrics for m in ("rouge-1", "rouge-2", "rouge-l", "bleu-4")):
        out.update({k: v for k, v in similarity(answer, reference).items() if k in metrics})
    if any(m in metrics for m in ("tool_name", "tool_args", "tool_json")):
        names = {t["function"]["name"] if "function" in t else t["name"] for t in tools or []}
        made, valid = _answer_calls(answer, names | {c["function"]["name"] for c in calls or []})
        wanted = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls or []]
        applies = bool(calls)
        tool = {
            "tool_name": float([c["name"] for c in made] == [c["name"] for c in wanted]) if applies else None,
            "tool_args": float(made == wanted) if applies else None,
            "tool_json": float(valid) if applies else None,
        }
        out.update({k: v for k, v in tool.items() if k in metrics})
    if "length" in metrics:
        out["length"] = float(completion_tokens)
    return out


def means(rows: list[dict[str, Any]], metrics: list[str]) -> dict[str, Any]:
    """Per candidate: each metric's mean over the rows it applies to, overall and per source, with row counts.

    Args:
        rows: ``{"candidate", "source", "scores": {metric: value or None}}`` per answer.
    Returns:
        ``{candidate: {"rows": n, "metrics": {m: mean}, "covered": {m: rows}, "sources": {source: {m: mean}},
        "source_rows": {source: n}}}``;
        a metric no row of a candidate covers is left out.
    """
    values: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    counts: dict[str, int] = defaultdict(int)
    per_source: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        counts[row["candidate"]] += 1
        per_source[row["candidate"]][row["source"]] += 1
        for m in metrics:
            v = row["scores"].get(m)
            if v is not None:
                values[row["candidate"]]["*"][m].append(v)
                values[row["candidate"]][row["source"]][m].append(v)
    out: dict[str, Any] = {}
    for candidate, n in counts.items():
        groups = values[candidate]
        mean = {m: round(sum(v) / len(v), 4) for m, v in groups["*"].items()}
        out[candidate] = {
            "rows": n,
            "metrics": {m: mean[m] for m in METRICS if m in mean},
            "covered": {m: len(groups["*"][m]) for m in METRICS if m in mean},
            "sources": {s: {m: round(sum(v) / len(v), 4) for m, v in g.items()} for s, g in groups.items() if s != "*"},
            "source_rows": dict(per_source[candidate]),
        }
    return out
