"""What ``raylora eval`` compares: the base model and adapters, named in ``eval.candidates``, found and checked on
the driver before Ray starts.

A candidate is ``base``, an adapter folder (peft's ``save_pretrained`` output), ``models:/NAME/VERSION`` or
``models:/NAME/latest`` from the MLflow registry (downloaded into ``eval.output_dir/adapters``), or a sweep's output
folder, which stands for every trial that completed (``trials/<id>/adapter``). Each adapter is checked against the
base model's shapes (:func:`raylora.serve.compat.check_compatible` on the meta-device skeleton: no weight is read).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from raylora.config import JobConfig
from raylora.registry import CONFIG, AdapterError, download, registered_version
from raylora.runs import RUN_FILE
from raylora.serve.compat import check_compatible
from raylora.tracking import tracking_uri

BASE = "base"


@dataclass(frozen=True)
class Candidate:
    """One answering model.

    Attributes:
        name: its name in reports and MLflow, unique (``base``, the adapter's folder, ``trial-<id>``, ``NAME-vN``).
        spec: the ``eval.candidates`` entry it came from.
        path: the adapter folder, or None for the base model.
        run_id: the MLflow run that trained it, when known (the run's ``mlflow_run.json``, the registered version's).
    """

    name: str
    spec: str
    path: str | None = None
    run_id: str | None = None


def resolve(cfg: JobConfig, skeleton: torch.nn.Module) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The candidates of ``eval.candidates`` and every problem found with them (``(key, message)``)."""
    found: list[Candidate] = []
    problems: list[tuple[str, str]] = []
    for k, spec in enumerate(cfg.eval.candidates):
        key = f"eval.candidates[{k}]"
        try:
            found += _expand(cfg, spec)
        except (AdapterError, ValueError) as e:
            problems.append((key, str(e)))
    for c in found:
        if c.path is None:
            continue
        try:
            check_compatible(Path(c.path), skeleton, cfg.serve.max_lora_rank)
        except AdapterError as e:
            problems.append((f"eval.candidates[{cfg.eval.candidates.index(c.spec)}]", f"{c.path}: {e}"))
    return _unique(found), problems


def _expand(cfg: JobConfig, spec: str) -> list[Candidate]:
    if spec == BASE:
        return [Candidate(BASE, spec)]
    if spec.startswith("models:/"):
        if not cfg.tracking.enabled:
            raise ValueError(f"{spec} is in the MLflow registry, and tracking.enabled is false")
        uri = tracking_uri(cfg.tracking)
        name, version, run_id = registered_version(uri, spec)
        dest = Path(cfg.eval.output_dir).resolve() / "adapters" / f"{name}-v{version}"
        if not (dest / CONFIG).is_file():  # a version is immutable: one downloaded before is reused
            staging = dest.parent / f".{dest.name}-download"
            shutil.rmtree(staging, ignore_errors=True)
            download(uri, f"models:/{name}/{version}", staging).rename(dest)
            shutil.rmtree(staging)
        return [Candidate(f"{name}-v{version}", spec, str(dest), run_id)]
    folder = Path(spec).resolve()
    if (folder / CONFIG).is_file():
        name = folder.parent.name if folder.name == "adapter" else folder.name
        return [Candidate(name, spec, str(folder), _run_id(folder.parent if folder.name == "adapter" else folder))]
    if (folder / "trials").is_dir():
        trials = sorted(p for p in (folder / "trials").iterdir() if (p / "adapter" / CONFIG).is_file())
        if not trials:
            raise ValueError(f"the sweep in {folder} has no completed trial (no trials/<id>/adapter)")
        return [Candidate(f"trial-{p.name}", spec, str(p / "adapter"), _run_id(p)) for p in trials]
    if not folder.exists():
        raise ValueError(f"{spec}: no such folder (nor base, nor models:/NAME/VERSION)")
    raise ValueError(f"{folder} is neither an adapter folder (no {CONFIG}) nor a sweep's output folder (no trials/)")


def _run_id(folder: Path) -> str | None:
    saved = folder / RUN_FILE
    return json.loads(saved.read_text())["run_id"] if saved.is_file() else None


def _unique(found: list[Candidate]) -> list[Candidate]:
    """The candidates with repeated entries dropped and clashing names made distinct (``name``, ``name-2``)."""
    out: list[Candidate] = []
    seen: set[tuple[str | None, str]] = set()
    names: set[str] = set()
    for c in found:
        if (c.path, c.name if c.path is None else "") in seen:
            continue
        seen.add((c.path, c.name if c.path is None else ""))
        name, k = c.name, 2
        while name in names:
            name, k = f"{c.name}-{k}", k + 1
        names.add(name)
        out.append(Candidate(name, c.spec, c.path, c.run_id))
    return out
