"""Where the server finds LoRA adapters, safely: an adapter root folder and the MLflow model registry.

The OpenAI ``model`` field of a request names either the base model or an adapter. Adapter names are
checked before they touch the file system, so a request can never reach outside the adapter root::

    <adapter_root>/
        <name>/                         peft save_pretrained output, installed by POST /v1/adapters
            adapter_config.json
            adapter_model.safetensors   (or adapter_model.bin)
        .registry/<name>/<version>/     MLflow registered adapters, downloaded once and reused
        .tmp-*/                         downloads and copies in progress (renamed into place when whole)

Registered adapters come from the MLflow model registry (:mod:`raylora.registry`); whether an adapter
fits the served model is :mod:`raylora.serve.compat`'s. Every failure is an :class:`AdapterError`
carrying the HTTP status and a short code the server answers with.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raylora.registry import CONFIG, WEIGHTS, AdapterError, check_name, download, latest_version

REGISTRY_CACHE = ".registry"
MLFLOW_SCHEMES = ("runs:/", "models:/")


def local_adapter(root: Path, name: str) -> Path:
    """The folder of adapter ``name`` in ``root``, resolved and guaranteed to lie inside ``root``.

    Args:
        root: the adapter root (``serve.adapter_root``).
        name: the adapter name, checked with :func:`check_name`.
    Returns:
        The resolved folder, holding ``adapter_config.json`` and the adapter weights.
    Raises:
        AdapterError: 400 for a bad name or a symlink leading outside ``root`` (never followed);
            404 ``adapter_not_found`` when the folder or its files are missing.
    """
    base = root.resolve()
    folder = root / check_name(name)
    files = [folder, folder / CONFIG, *(folder / w for w in WEIGHTS)]
    escaping = [p for p in files if (p.exists() or p.is_symlink()) and not _inside(p, base)]
    if escaping:
        raise AdapterError(
            400,
            "adapter_outside_root",
            f"adapter {name!r}: {escaping[0]} is a link to {escaping[0].resolve()}, outside the adapter root {base}. "
            f"Copy the adapter into {base / name} instead of linking to it.",
        )
    if not adapter_files(folder):
        raise AdapterError(
            404,
            "adapter_not_found",
            f"no adapter named {name!r}: expected a folder {base / name} holding {CONFIG} and {WEIGHTS[0]} "
            f"(or {WEIGHTS[1]}). Install it with POST /v1/adapters or copy a peft save_pretrained folder there.",
        )
    return folder.resolve()


def list_local(root: Path) -> list[str]:
    """Sorted names of the servable adapters in ``root`` (empty when ``root`` does not exist).

    Entries with invalid or hidden names (the ``.registry`` cache, unfinished ``.tmp-*`` copies), links
    leading outside ``root`` and folders without adapter files are skipped.
    """
    if not root.is_dir():
        return []
    names = []
    for entry in sorted(root.iterdir()):
        try:
            local_adapter(root, entry.name)
        except AdapterError:
            continue
        names.append(entry.name)
    return names


def fetch_registered(tracking_uri: str, name: str, root: Path) -> Path:
    """Download the latest version of registered adapter ``name`` into ``root/.registry/<name>/<version>``.

    The download goes to a temporary folder in ``root/.registry`` and is renamed into place once whole
    and checked, so a crash never leaves half an adapter behind; a version already there is reused.

    Args:
        tracking_uri: the MLflow store (an absolute ``sqlite:////...`` path or a server URL).
        name: the registered model name, checked with :func:`check_name`.
        root: the adapter root.
    Returns:
        The resolved adapter folder.
    Raises:
        AdapterError: 400 bad name or failed download; 404 unknown name, a registered model that is not
            tagged as an adapter, or one without versions; 422 when the artifacts are not a LoRA adapter.
    """
    version, uri = latest_version(tracking_uri, check_name(name))
    dest = root / REGISTRY_CACHE / name / str(version)
    if not adapter_files(dest):
        with _staging(root / REGISTRY_CACHE) as tmp:
            folder = download(tracking_uri, uri, tmp)
            lora_config(folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            _publish(folder, dest)  # a concurrent fetch may publish first; its copy is the same version
    return dest.resolve()


def install(root: Path, name: str, source: str, tracking_uri: str | None) -> Path:
    """Install an adapter as ``root/name`` (``POST /v1/adapters``), atomically.

    The source is copied (or downloaded) into a hidden temporary folder in ``root``, checked to be a
    LoRA adapter, then renamed to ``root/name``: a half-copied adapter is never visible.

    Args:
        root: the adapter root (created when missing).
        name: the new adapter's name, checked with :func:`check_name`.
        source: an MLflow URI (``runs:/<run_id>/<path>``, ``models:/<name>/<version>``,
            ``models:/<name>@<alias>``, ``models:/<name>/latest``) or a local adapter folder, such as a
            training run's ``outputs/<run>/adapter``. A local folder must not contain symlinks.
        tracking_uri: the MLflow store; required for MLflow sources.
    Returns:
        The resolved installed folder.
    Raises:
        AdapterError: 400 bad name or unusable source (the message gives the reason); 409 when an
            adapter named ``name`` already exists.
    """
    dest = root / check_name(name)
    _refuse_existing(dest)
    with _staging(root) as tmp:
        folder = _stage_source(source, tmp, tracking_uri)
        try:
            lora_config(folder)
        except AdapterError as e:
            raise AdapterError(400, "invalid_adapter_source", f"source {source!r} is not usable: {e}") from None
        if not _publish(folder, dest):
            _refuse_existing(dest)
    return dest.resolve()


def _inside(path: Path, base: Path) -> bool:
    """Whether ``path``, with every link followed, lies strictly inside ``base`` (a resolved folder)."""
    resolved = path.resolve()
    return resolved != base and resolved.is_relative_to(base)


def adapter_files(folder: Path) -> list[Path]:
    """``[config, weights]`` of an adapter folder, or ``[]`` when either file is missing."""
    weights = [folder / w for w in WEIGHTS if (folder / w).is_file()]
    return [folder / CONFIG, weights[0]] if (folder / CONFIG).is_file() and weights else []


def lora_config(folder: Path) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of a complete LoRA adapter folder.

    Raises:
        AdapterError: 422 ``adapter_incompatible`` when files are missing, the config is not JSON, or
            ``peft_type`` is not ``LORA``.
    """
    if not adapter_files(folder):
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "nothing, it is not a folder"
        raise _not_lora(f"{folder} lacks {CONFIG} or {WEIGHTS[0]} ({WEIGHTS[1]}); found {found}")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _not_lora(f"{folder / CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else None
        raise _not_lora(f"{folder / CONFIG} has peft_type {found!r}, not 'LORA'")
    return config


def _not_lora(problem: str) -> AdapterError:
    """The 422 error for a folder that is not a peft LoRA adapter."""
    return AdapterError(
        422,
        "adapter_incompatible",
        f"not a LoRA adapter: {problem}. Expected a peft LoRA save_pretrained folder (e.g. a training run's "
        "outputs/<run>/adapter).",
    )


@contextmanager
def _staging(parent: Path) -> Iterator[Path]:
    """A fresh hidden folder in ``parent`` (same file system, so renaming out of it is atomic), removed on exit."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(folder: Path, dest: Path) -> bool:
    """Rename ``folder`` to ``dest`` in one step; ``False`` when ``dest`` appeared meanwhile."""
    try:
        os.rename(folder, dest)
    except OSError:
        if dest.exists():
            return False
        raise
    return True


def _refuse_existing(dest: Path) -> None:
    """Raise 409 ``adapter_exists`` when ``dest`` (or a link of that name) exists."""
    if dest.exists() or dest.is_symlink():
        raise AdapterError(
            409,
            "adapter_exists",
            f"an adapter named {dest.name!r} already exists in {dest.parent}. Choose another name, or delete "
            f"{dest} first to replace it.",
        )


def _stage_source(source: str, tmp: Path, tracking_uri: str | None) -> Path:
    """Bring ``source`` (MLflow URI or local folder) into ``tmp``; returns the folder holding it."""
    if source.startswith(MLFLOW_SCHEMES):
        if tracking_uri is None:
            raise AdapterError(
                400,
                "invalid_adapter_source",
                f"source {source!r} is an MLflow URI but no MLflow store is configured. Set tracking.uri "
                "(an absolute sqlite:////... path or a server URL), or give a local adapter folder.",
            )
        return download(tracking_uri, source, tmp)
    if "://" in source:
        raise AdapterError(
            400,
            "invalid_adapter_source",
            f"source {source!r} has an unsupported scheme: expected runs:/<run_id>/<path>, "
            "models:/<name>/<version>, or a local adapter folder.",
        )
    return _copy_local(Path(source).expanduser().absolute(), tmp / "adapter")


def _copy_local(src: Path, dst: Path) -> Path:
    """Copy the adapter folder ``src`` to ``dst``; returns ``dst``.

    Raises:
        AdapterError: 400 when ``src`` is not a folder, contains symlinks (copying them would let an
            adapter read files from anywhere on the server) or is not a LoRA adapter.
    """
    if not src.is_dir():
        raise AdapterError(
            400,
            "invalid_adapter_source",
            f"source {str(src)!r} is not a folder on the server. Give the adapter folder written by training "
            "(outputs/<run>/adapter) or an MLflow URI.",
        )
    links = [p for p in (src, *src.rglob("*")) if p.is_symlink()]
    if links:
        raise AdapterError(
            400,
            "invalid_adapter_source",
            f"source {str(src)!r} contains the symlink {links[0]}; adapters are installed from real files only. "
            "Copy the files it points to into the folder.",
        )
    try:
        lora_config(src)  # before copying: a training run's whole folder (checkpoints and all) is not an adapter
    except AdapterError as e:
        raise AdapterError(400, "invalid_adapter_source", f"source {str(src)!r} is not usable: {e}") from None
    shutil.copytree(src, dst)
    return dst
