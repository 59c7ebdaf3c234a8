"""LLaMA-Factory's dataset registry: ``data.sources[].name`` picks a dataset of a ``dataset_info.json``.

A registry written for LLaMA-Factory works unchanged. An entry such as::

    "glaive_toolcall_en_demo": {"file_name": "glaive_toolcall_en_demo.json", "formatting": "sharegpt",
                                "columns": {"messages": "conversations", "tools": "tools"}}

becomes a source: ``file_name`` (a file or folder, relative to the registry's folder), ``formatting``
(``alpaca`` by default, ``sharegpt`` or ``openai``), its ``columns`` and sharegpt ``tags`` translated to the
names of :data:`~raylora.data.formats.DEFAULT_COLUMNS`. An alpaca entry with a prompt column and no response
is pre-training text, as in LLaMA-Factory. A ``ranking: true`` entry names its answers' ``chosen`` and
``rejected`` columns (preference pairs, :mod:`raylora.data.preference`). What raylora cannot honour (hub and
cloud datasets, KTO's and multimodal columns, sampling) is refused with the reason, never skipped.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

ALPACA_COLUMNS = {
    "prompt": "instruction", "query": "input", "response": "output", "system": "system", "history": "history",
    "tools": "tools",
}  # fmt: skip
CHAT_COLUMNS = {"messages": "messages", "system": "system", "tools": "tools"}
TAGS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
# the roles of raylora's openai format, by LLaMA-Factory tag
OPENAI_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "system_tag": "system", "observation_tag": "tool"}
KEYS = ("file_name", "formatting", "columns", "tags", "ranking", "split", "file_sha1")
REFUSED = {
    "hf_hub_url": "a Hugging Face hub dataset: raylora reads local files only; download it and give file_name",
    "ms_hub_url": "a ModelScope dataset: raylora reads local files only; download it and give file_name",
    "om_hub_url": "a Modelers dataset: raylora reads local files only; download it and give file_name",
    "script_url": "a loading script: raylora reads local files only; save its rows as JSON and give file_name",
    "cloud_file_name": "a cloud file: raylora reads local files only; copy it here and give file_name",
    "num_samples": "sampling by count: use data.sources[].weight or data.max_samples instead",
    "subset": "a hub subset: raylora reads local files only",
    "folder": "a hub folder: raylora reads local files only",
}
REFUSED_COLUMNS = ("images", "videos", "audios")
RANKING_COLUMNS = ("chosen", "rejected")  # a ranking entry's answers, as raylora's columns name them too


class RegistryError(ValueError):
    """A registry that cannot be read, or a dataset it does not hold or raylora cannot read."""


def load_registry(path: str) -> dict[str, Any]:
    """The datasets of a ``dataset_info.json``, by name.

    Raises:
        RegistryError: the file is missing, not JSON, or not an object of objects.
    """
    p = Path(path)
    if not p.is_file():
        raise RegistryError(f"data.dataset_info: {p} does not exist (a LLaMA-Factory dataset_info.json)")
    try:
        registry = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RegistryError(f"data.dataset_info: {p} is not valid JSON ({e})") from None
    if not isinstance(registry, dict) or not all(isinstance(v, dict) for v in registry.values()):
        raise RegistryError(f"data.dataset_info: {p} must hold an object of datasets, each an object")
    return registry


def resolve(registry: dict[str, Any], path: str, name: str) -> dict[str, Any]:
    """The source a registry names: ``{"path", "format", "columns"}`` in raylora's terms.

    Args:
        registry: from :func:`load_registry`.
        path: the registry file (``file_name`` is relative to its folder).
        name: the dataset.
    Raises:
        RegistryError: an unknown name (with the nearest names), or an entry raylora cannot read.
    """
    if name not in registry:
        near = difflib.get_close_matches(name, list(registry), n=3, cutoff=0.5)
        hint = f"; nearest: {', '.join(near)}" if near else f"; it holds {', '.join(sorted(registry)[:10])}"
        raise RegistryError(f"dataset {name!r} is not in {path}{hint}")
    entry = registry[name]
    where = f"{path}: dataset {name!r}"
    refused = [f"{key} ({REFUSED[key]})" for key in entry if key in REFUSED]
    unknown = [key for key in entry if key not in REFUSED and key not in KEYS]
    if refused or unknown:
        raise RegistryError(
            f"{where} uses "
            + "; ".join(
                refused + [f"{key} (not a LLaMA-Factory key raylora knows: {', '.join(KEYS)})" for key in unknown]
            )
        )
    if not isinstance(entry.get("file_name"), str):
        raise RegistryError(f"{where} has no file_name (the data file or folder, beside {Path(path).name})")
    columns = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    if not isinstance(columns, dict) or not isinstance(tags, dict):
        raise RegistryError(f"{where}: columns and tags must be objects")
    bad = [c for c in columns if c in REFUSED_COLUMNS]
    if bad:
        raise RegistryError(f"{where} has {', '.join(bad)} columns; raylora trains on text conversations only")
    ranked = {k: v for k, v in columns.items() if k in RANKING_COLUMNS}
    if ranked and not entry.get("ranking"):
        raise RegistryError(
            f"{where} has {', '.join(ranked)} columns but not ranking: true (LLaMA-Factory reads them only then)"
        )
    tagged = {k: v for k, v in columns.items() if k == "kto_tag"}  # KTO's label field (train.objective: kto)
    rest = {k: v for k, v in columns.items() if k not in RANKING_COLUMNS and k not in tagged}
    fmt, ours = _translate(entry.get("formatting", "alpaca"), rest, tags, where, bool(entry.get("ranking")))
    path = str(Path(path).resolve().parent / entry["file_name"])
    return {"path": path, "format": fmt, "columns": {**ours, **ranked, **tagged}}


def _translate(formatting: str, columns: dict, tags: dict, where: str, ranking: bool) -> tuple[str, dict[str, str]]:
    if formatting == "alpaca":
        unknown = sorted(set(columns) - set(ALPACA_COLUMNS))
        if unknown or tags:
            raise RegistryError(
                f"{where}: alpaca columns are {', '.join(ALPACA_COLUMNS)} (got {', '.join(unknown or tags)})"
            )
        if "prompt" in columns and "response" not in columns and len(columns) == 1 and not ranking:
            return "text", {"text": columns["prompt"]}  # LLaMA-Factory's pre-training data
        return "alpaca", {ALPACA_COLUMNS[k]: v for k, v in columns.items()}
    if formatting not in ("sharegpt", "openai"):
        raise RegistryError(f"{where}: formatting {formatting!r} is not alpaca, sharegpt or openai")
    unknown = sorted(set(columns) - set(CHAT_COLUMNS)) + sorted(set(tags) - set(TAGS))
    if unknown:
        raise RegistryError(
            f"{where}: {', '.join(unknown)} unknown; columns are {', '.join(CHAT_COLUMNS)}, tags {', '.join(TAGS)}"
        )
    standard = all(tags.get(tag, role) == role for tag, role in OPENAI_ROLES.items()) and "function_tag" not in tags
    if formatting == "openai" and standard and "system" not in columns:
        ours = {k: v for k, v in {**columns, **tags}.items() if k not in OPENAI_ROLES}
        return "openai", ours
    # sharegpt, or openai-style messages with their own role names (LLaMA-Factory reads both the same way)
    ours = {**columns, **tags}
    if formatting == "openai":
        ours = {"messages": "messages", "role_tag": "role", "content_tag": "content", **OPENAI_ROLES, **ours}
    return "sharegpt", ours
