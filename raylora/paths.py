"""Where a job's relative output paths go, so that nothing it writes lands in a folder Ray deletes, and where its
relative inputs are read from.

``ray job submit --working-dir .`` runs the entry script inside Ray's temporary copy of the working
folder (``.../runtime_resources/working_dir_files/_ray_pkg_<hash>``), which Ray garbage-collects.
A relative output path there would silently put the adapter, the shards or the MLflow store into
that copy. :func:`anchor_outputs` makes every output path a command writes absolute against a
durable folder: ``$RAYLORA_BASE_DIR`` when set (the submitting folder, passed in the job's
environment), else the working folder, except inside Ray's copy, where a relative output path is
refused with the fix.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from pathlib import Path

from raylora.config import ConfigError, JobConfig

BASE_ENV = "RAYLORA_BASE_DIR"
RAY_COPY_MARK = "/runtime_resources/working_dir_files/"

# The config keys each command writes to (and, for tracking.uri, the default SQLite store it creates).
OUTPUTS = {
    "prepare": ("data.output_dir",),
    "train": ("data.output_dir", "train.output_dir", "tracking.uri"),
    "tune": ("data.output_dir", "train.output_dir", "tracking.uri"),
    "quickstart": ("train.output_dir",),
    "export": ("export.output_dir",),
    "eval": ("eval.output_dir", "tracking.uri"),
    "serve": ("serve.adapter_root", "tracking.uri"),
    "demo": ("data.output_dir", "train.output_dir", "export.output_dir", "serve.adapter_root", "tracking.uri"),
}


def cache_home() -> Path:
    """raylora's cache of things made once per machine (converted models, an empty MLflow store): ``$RAYLORA_CACHE``,
    else ``~/.cache/raylora``."""
    return Path(os.environ.get("RAYLORA_CACHE") or "~/.cache/raylora").expanduser().resolve()


def in_ray_copy(folder: Path) -> bool:
    """Whether ``folder`` lies in Ray's temporary copy of a job's working folder."""
    return RAY_COPY_MARK in f"{folder.resolve()}/"


def anchor_outputs(cfg: JobConfig, command: str, source: str = "config") -> JobConfig:
    """``cfg`` with the output paths of ``command`` made absolute against the durable base folder.

    Args:
        cfg: the validated job.
        command: a ``raylora`` command; commands not in :data:`OUTPUTS` write nothing.
        source: the config file's name, for the error.
    Returns:
        A new config; ``tracking.uri`` becomes ``sqlite:///<base>/mlflow.db`` when tracking is on and unset,
        and a relative SQLite path is made absolute.
    Raises:
        ConfigError: inside Ray's temporary copy with ``$RAYLORA_BASE_DIR`` unset, naming every relative
            output path and both fixes.
    """
    keys = OUTPUTS.get(command, ())
    chosen = os.environ.get(BASE_ENV)
    cwd = Path.cwd()
    if chosen and not Path(chosen).is_absolute():
        raise ConfigError([(f"${BASE_ENV}", f"got {chosen!r}; it must be an absolute folder")], source)
    if chosen and not Path(chosen).is_dir():  # a typo would put every output in a new folder, and find no input
        raise ConfigError([(f"${BASE_ENV}", f"{chosen} is not a folder on this machine; name the submitting folder")],
                          source)  # fmt: skip
    base = Path(chosen) if chosen else cwd
    refuse = not chosen and in_ray_copy(cwd)
    problems: list[tuple[str, str]] = []
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for key in keys:
        section, name = key.split(".")
        value = getattr(sections[section], name)
        if key == "tracking.uri":
            if not cfg.tracking.enabled:
                continue
            relative = _relative_sqlite(value)
            if relative is None:
                continue
            fixed, absolute = f"sqlite:///{base / relative}", f"sqlite:////abs/folder/{relative}"
        else:
            if Path(value).is_absolute():
                continue
            fixed, absolute = str(base / value), f"/abs/folder/{value}"
        if refuse:
            problems.append((key, _refusal(value, cwd, key, absolute)))
        else:
            sections[section] = dataclasses.replace(sections[section], **{name: fixed})
    if problems:
        raise ConfigError(problems, source)
    return dataclasses.replace(cfg, **sections)


def anchor_inputs(cfg: JobConfig) -> JobConfig:
    """``cfg`` with each relative input path (data sources, ``data.dataset_info``, ``model.name_or_path``,
    ``export.adapter``, ``eval.sources``, ``eval.candidates``) that names nothing in the working folder but something under ``$RAYLORA_BASE_DIR`` made
    absolute there.

    A job runs in Ray's copy of the working folder, which holds what ``--working-dir`` uploaded, not
    ``../shared/data`` beside it. Paths found in the working folder, and registry names found nowhere, stay as given;
    without ``$RAYLORA_BASE_DIR`` nothing changes.
    """
    chosen = os.environ.get(BASE_ENV)
    if not chosen:
        return cfg
    base = Path(chosen)

    def moved(value: str | None) -> str | None:
        if value is None or Path(value).is_absolute() or glob.glob(value):
            return value
        return str(base / value) if glob.glob(str(base / value)) else value

    data = dataclasses.replace(
        cfg.data,
        sources=[dataclasses.replace(s, path=moved(s.path)) for s in cfg.data.sources],
        dataset_info=moved(cfg.data.dataset_info),
    )
    model = dataclasses.replace(cfg.model, name_or_path=moved(cfg.model.name_or_path))
    evaluation = dataclasses.replace(
        cfg.eval,
        sources=[dataclasses.replace(s, path=moved(s.path)) for s in cfg.eval.sources],
        candidates=[c if c == "base" or c.startswith("models:/") else moved(c) for c in cfg.eval.candidates],
    )
    return dataclasses.replace(
        cfg, data=data, model=model, export=dataclasses.replace(cfg.export, adapter=moved(cfg.export.adapter)),
        eval=evaluation,
    )  # fmt: skip


def _relative_sqlite(uri: str | None) -> str | None:
    """The relative file of a SQLite URI (``mlflow.db`` for ``None``, MLflow's default); ``None`` if absolute or not SQLite."""
    if uri is None:
        return "mlflow.db"
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///")
    return None if path.startswith("/") or path == ":memory:" else path


def _refusal(value: str | None, cwd: Path, key: str, absolute: str) -> str:
    shown = "unset (mlflow.db in the working folder)" if value is None else repr(value)
    return (
        f"{shown} is relative, and this job runs in Ray's temporary copy of the working folder ({cwd}), which Ray "
        f"deletes: what it wrote there would be lost. Give an absolute path ({key}={absolute}), or send the "
        f"folder relative paths should mean: ray job submit --runtime-env-json "
        f'\'{{"env_vars": {{"{BASE_ENV}": "\'$PWD\'"}}}}\' ...'
    )
