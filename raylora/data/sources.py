"""Which files a job reads and how (``plan_sources``), and the first valid conversations of them.

Kept apart from the Ray Data pipeline so that a serving replica calibrating SmoothQuant, or the single-process
quickstart, reads sample rows without importing Ray Data.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from raylora.config import DataArgs
from raylora.data.dataset_info import RegistryError, load_registry, resolve
from raylora.data.encode import Encoder, tokenizer_spec
from raylora.data.formats import (
    DEFAULT_COLUMNS,
    FORMATS,
    PAIR_COLUMNS,
    PREFERENCE,
    Conversation,
    RowError,
    detect_format,
    is_preference,
)
from raylora.data.preference import (
    KTO_COLUMNS,
    UNLABELLED,
    UNPAIRED,
    Pair,
    Unpaired,
    conversations,
    fits,
    is_unpaired,
    pair_format,
    read_row,
)
from raylora.data.read import expand, first_row, iter_raw
from raylora.data.transforms import copies_of, split_draw
from raylora.errors import BadInput


class DataError(BadInput, ValueError):
    """The data cannot be prepared: bad sources, or too many rejected rows."""


SUPERVISED = (
    "a row with one answer (supervised fine-tuning data), but train.objective is {objective}, which needs a chosen "
    "and a rejected answer per prompt: train.objective: sft fits this file"
)


def plan_sources(data: DataArgs, objective: str = "sft") -> dict[str, dict[str, Any]]:
    """Per data file: its format (declared or detected from the first row), column names and weight, and
    ``"pairs": True`` for a preference file (read by :func:`~raylora.data.preference.to_pair`), ``"unpaired": True``
    for KTO's (:func:`~raylora.data.preference.to_unpaired`).

    Every file is checked before the pipeline starts: a file that does not parse, whose first row is not the
    declared format or does not fit ``objective`` (a preference or labelled row under ``sft``, a row with one answer
    or KTO's labelled row under a paired objective, a row without a label under ``kto``), or that two sources name,
    fails here, naming the file and line.
    Args:
        data: the job's data settings.
        objective: ``train.objective``: ``sft``, or a preference objective (``dpo``, ``simpo``, ``orpo``, ``kto``).
    Raises:
        DataError: listing every problem found.
    """
    if not data.sources:
        raise DataError("data.sources is empty: name at least one data file, folder or glob")
    plan: dict[str, dict[str, Any]] = {}
    owner: dict[str, int] = {}  # file -> the source that named it first
    problems = []
    preference = objective != "sft"
    if preference and data.train_on_prompt:
        problems.append(
            f"data.train_on_prompt: train.objective: {objective} compares the answers after a prompt both share; "
            "the prompt is never learned, so set data.train_on_prompt: false"
        )
    registry = None
    if any(source.name is not None for source in data.sources):
        try:
            registry = load_registry(data.dataset_info)
        except RegistryError as e:
            problems.append(str(e))
    for k, source in enumerate(data.sources):
        path, fmt_declared, columns = source.path, source.format, source.columns
        if source.name is not None:
            if registry is None:
                continue
            try:
                entry = resolve(registry, data.dataset_info, source.name)
            except RegistryError as e:
                problems.append(f"data.sources[{k}].name: {e}")
                continue
            path, columns = entry["path"], {**entry["columns"], **source.columns}
            fmt_declared = entry["format"] if source.format == "auto" else source.format
        formats = FORMATS if fmt_declared == "auto" else (fmt_declared,)
        valid = {*PAIR_COLUMNS, *KTO_COLUMNS, *(name for fmt in formats for name in DEFAULT_COLUMNS[fmt])}
        unknown = sorted(set(columns) - valid)
        if unknown:
            problems.append(
                f"data.sources[{k}].columns: unknown field {', '.join(unknown)}; known: {', '.join(sorted(valid))}"
            )
        try:
            files = expand(path)
        except (FileNotFoundError, ValueError) as e:
            problems.append(str(e))
            continue
        for path in files:
            if path in owner:
                problems.append(
                    f"{path} is read by data.sources[{owner[path]}] and data.sources[{k}]: name each file once "
                    "(weight: 2 reads a file twice)"
                )
                continue
            owner[path] = k
            try:
                line, row = first_row(path)
            except ValueError as e:
                problems.append(str(e))
                continue
            pairs, unpaired = is_preference(row, columns), is_unpaired(row, columns)
            if objective == "kto":
                if not unpaired:
                    problems.append(f"{path}:{line}: {UNLABELLED}")
                    continue
                detected = "openai" if isinstance(row, dict) and "completion" in row else detect_format(row)
                plan[path] = {"format": detected if fmt_declared == "auto" else fmt_declared, "columns": columns,
                              "weight": source.weight, "unpaired": True}  # fmt: skip
                continue
            if unpaired:
                problems.append(f"{path}:{line}: {UNPAIRED}, not {objective}")
                continue
            if pairs != preference:
                problems.append(
                    f"{path}:{line}: {SUPERVISED.format(objective=objective) if preference else PREFERENCE}"
                )
                continue
            detected = pair_format(row) if pairs else detect_format(row)
            fmt = detected if fmt_declared == "auto" else fmt_declared
            if fmt is None:
                keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                problems.append(
                    f"{path}:{line}: cannot tell the format from the first row (keys: {keys}); set data.sources[{k}].format"
                )
                continue
            expected = DEFAULT_COLUMNS[fmt]
            main = {**expected, **columns}[next(iter(expected))]
            if (
                fmt_declared != "auto"
                and isinstance(row, dict)
                and not (fits(row, fmt, columns) if pairs else main in row)
            ):
                problems.append(
                    f"{path}:{line}: is not {fmt} {'preference ' * pairs}data: the first row has keys "
                    f"{', '.join(row)}, not {main!r} (map names with data.sources[{k}].columns)"
                )
                continue
            plan[path] = {"format": fmt, "columns": columns, "weight": source.weight}
            if pairs:
                plan[path]["pairs"] = True
    if problems:
        raise DataError("data problems:\n  - " + "\n  - ".join(problems))
    return plan


def conversation_of(row: Any, how: dict[str, Any], data: DataArgs) -> Conversation:
    """One parsed row as a conversation: its own, a preference pair's prompt and chosen answer, or a KTO row's prompt
    and desirable answer (what evaluation compares answers with, and what calibration renders).

    Raises:
        RowError: the row cannot be used; the message says why.
    """
    item = read_row(row, how, data)
    if isinstance(item, Unpaired):
        if not item.desirable:
            raise RowError("an undesirable answer (label false): not a reference")
        return Conversation(item.prompt + item.answer, item.tools)
    return conversations(item)[0] if isinstance(item, Pair) else item


def sample_conversations(data: DataArgs, n: int, skip: int = 0, objective: str = "sft") -> list[Conversation]:
    """The first valid conversations of ``data.sources`` in file order, after ``skip`` of them (calibration, evaluation);
    of preference data (``objective`` other than ``sft``), each pair's prompt and chosen answer.

    Rows that do not parse are passed over; :func:`prepare` is where they are counted and written aside.
    """
    out: list[Conversation] = []
    for path, how in plan_sources(data, objective).items():
        with open(path, "rb") as f:
            for _, raw, error in iter_raw(f, path):
                if error is not None:
                    continue
                try:
                    conversation = conversation_of(json.loads(raw), how, data)
                except (RowError, ValueError):
                    continue
                if skip:
                    skip -= 1
                    continue
                out.append(conversation)
                if len(out) == n:
                    return out
    return out


def sample_token_ids(data: DataArgs, tokenizer, n: int, skip: int = 0, objective: str = "sft") -> list[list[int]]:
    """Token ids of :func:`sample_conversations` rendered with ``data.template`` (calibration, perplexity)."""
    encoder = Encoder(tokenizer_spec(tokenizer, data.template), data.cutoff_len, "tail", False)
    texts = [encoder.text(c) for c in sample_conversations(data, n, skip, objective)]
    return [tokenizer(t, add_special_tokens=False).input_ids[: data.cutoff_len] for t in texts]


def held_out_conversations(data: DataArgs, objective: str = "sft") -> list[Conversation]:
    """The rows ``raylora prepare`` puts in the eval split, as conversations (:func:`conversation_of`), in file order.

    Rows that do not parse are left out (``prepare`` rejects them). Returns an empty list without an eval split.
    """
    return [row for _, _, row in read_conversations(data, True, objective) if isinstance(row, Conversation)]


def read_conversations(
    data: DataArgs, held_out: bool, objective: str = "sft"
) -> list[tuple[str, int, Conversation | str]]:
    """Every row of ``data.sources`` (or only the eval split's) as ``(file, line, conversation)``
    (:func:`conversation_of`), in file order; a row that cannot be read has the reason in place of its conversation.

    The eval split follows the pipeline's rule: a row is held out when its seeded hash of ``(file name, line)`` falls
    under ``data.eval_fraction``, or, with ``data.eval_count``, when it is among the rows with the smallest hashes; and
    of a source weighted below 1 only the rows its weight keeps (:func:`~raylora.data.transforms.copies_of`) are in it, once each.
    """
    plan = plan_sources(data, objective)
    rows = []
    for path in sorted(plan):
        with open(path, "rb") as f:
            for line, raw, error in itertools.islice(iter_raw(f, path), data.max_samples):
                rows.append((split_draw(data.seed, path, line), path, line, raw, error))
    if not held_out:
        held = rows
    else:
        if data.eval_count:
            held = sorted(rows)[: data.eval_count]
        else:
            held = [r for r in rows if data.eval_fraction and r[0] < data.eval_fraction]
        held = [r for r in held if copies_of(data.seed, r[1], r[2], plan[r[1]]["weight"])]
    order = {path: k for k, path in enumerate(plan)}
    out: list[tuple[str, int, Conversation | str]] = []
    for _, path, line, raw, error in sorted(held, key=lambda r: (order[r[1]], r[2])):
        if error is not None:
            out.append((path, line, error))
            continue
        try:
            out.append((path, line, conversation_of(json.loads(raw), plan[path], data)))
        except (RowError, ValueError) as e:
            out.append((path, line, str(e)))
    return out
