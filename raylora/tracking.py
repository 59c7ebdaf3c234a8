"""MLflow tracking: one run per job, opened on the driver, written to by rank 0 only.

The driver creates the run (so a worker group restarted after a failure keeps logging to the same
run) and passes its id to the workers; :func:`metric_logger` gives rank 0 a logging function
and every other rank ``None``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylora.config import TrackingArgs
from raylora.errors import RunFailed
from raylora.paths import RAY_COPY_MARK, cache_home

# mlflow is imported inside the functions that talk to a store, after their "tracking off" early returns: it costs
# about 1.2 s to import (0.6 s after Ray), a job with tracking.enabled=false never pays it, and `raylora doctor`
# imports this module and must still run (and report it MISSING) where mlflow is not installed.


class TrackingError(RunFailed, RuntimeError):
    """The MLflow store cannot be reached; the message names the URI and the fix."""


def tracking_uri(args: TrackingArgs) -> str:
    """``tracking.uri`` if set, else an absolute SQLite file ``mlflow.db`` in the working folder.

    The path is made absolute here, on the driver, because MLflow resolves a relative SQLite path
    against each process's own working folder, and Ray workers run elsewhere.
    """
    return args.uri or f"sqlite:///{Path('mlflow.db').resolve()}"


def check_reachable(uri: str) -> None:
    """Fail fast, before any cluster work, when an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5) as response:
            response.read()
    except (urllib.error.URLError, OSError) as e:
        raise TrackingError(
            f"the MLflow tracking server {uri} does not answer ({getattr(e, 'reason', e)}). Start it "
            f"(mlflow server --host 127.0.0.1 --port ...), fix tracking.uri, or set tracking.enabled=false."
        ) from None


def start_run(
    args: TrackingArgs, run_name: str, params: dict[str, Any], tags: dict[str, str] | None = None
) -> str | None:
    """Create the job's run with its parameters and ``tags``; returns the run id (``None`` when tracking is off).

    A ``mlflow.parentRunId`` tag nests the run under that run (a sweep's trials under the sweep).
    """
    if not args.enabled:
        return None
    import mlflow  # only once tracking is on: see the note at the top

    uri = tracking_uri(args)
    check_reachable(uri)
    new_store(uri)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    run = client.create_run(experiment_id(client, uri, args.experiment), run_name=run_name, tags=tags)
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        chunk = list(params.items())[i : i + 100]
        client.log_batch(run.info.run_id, params=[mlflow.entities.Param(k, str(v)[:6000]) for k, v in chunk])
    return run.info.run_id


def new_store(uri: str) -> None:
    """Make the SQLite store ``uri`` when it does not exist yet, as a copy of an empty store that this MLflow version
    made once in raylora's cache (:func:`raylora.paths.cache_home`).

    MLflow makes a store by running every one of its schema migrations: 1.6 s of CPU on an idle 2-core machine, paid
    by every new store (each test's, each new job folder's); the copy takes 0.04 s. The copy differs from what MLflow
    makes in one value: its Default experiment keeps artifacts beside the store, as :func:`artifact_location` does
    for raylora's experiments, not in ``mlruns/`` of whichever working folder the first process had. Another process
    making the same store at the same moment is harmless: the first copy in place wins.
    """
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///"))
    if path.exists() or not path.parent.is_dir():  # a missing folder: MLflow's own error says so
        return
    import mlflow  # only once tracking is on: see the note at the top

    template = cache_home() / "mlflow" / f"empty-{mlflow.__version__}.db"
    if not template.is_file():
        template.parent.mkdir(parents=True, exist_ok=True)
        making = template.with_name(f"{template.name}.{os.getpid()}.tmp")
        making.unlink(missing_ok=True)
        mlflow.MlflowClient(f"sqlite:///{making}").search_experiments()  # runs the migrations
        os.replace(making, template)
    copy = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.copyfile(template, copy)
    with contextlib.closing(sqlite3.connect(copy)) as db, db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                   (f"{artifact_location(uri)}/0",))  # fmt: skip
    try:
        os.link(copy, path)
    except FileExistsError:
        pass
    finally:
        copy.unlink()


def reopen_run(args: TrackingArgs, run_id: str, params: dict[str, Any]) -> bool:
    """Mark ``run_id`` running again when this store holds it with exactly ``params``; whether it did."""
    import mlflow  # only once tracking is on: see the note at the top

    client = mlflow.MlflowClient(tracking_uri(args))
    try:
        run = client.get_run(run_id)
    except mlflow.exceptions.MlflowException:  # another store's run
        return False
    if run.info.lifecycle_stage != "active" or run.data.params != {k: str(v)[:6000] for k, v in params.items()}:
        return False  # deleted in MLflow, or other settings
    client.update_run(run_id, status="RUNNING")
    return True


def artifact_location(uri: str) -> str | None:
    """Where a new experiment's artifacts go, chosen explicitly so they never depend on a working folder.

    MLflow's default for a SQLite store is ``./mlruns`` resolved against the working folder of the
    process that creates the experiment; under ``ray job submit`` that is Ray's temporary copy of the
    job's folder, and every later run of the experiment would write there too.

    Returns:
        ``mlartifacts/`` beside a SQLite file; ``None`` (the store decides) for a tracking server,
        whose own artifact root applies, and for a ``file:`` store, which keeps artifacts in itself.
    Raises:
        TrackingError: another database URI, for which no durable local folder is known.
    """
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    if uri.startswith(("http://", "https://", "databricks")) or "://" not in uri or uri.startswith("file:"):
        return None
    raise TrackingError(
        f"tracking.uri={uri}: raylora cannot tell where artifacts of this store should live. Serve it with "
        f"`mlflow server --backend-store-uri {uri} --artifacts-destination <durable folder or bucket>` and set "
        "tracking.uri to the server's http:// address, or use an absolute sqlite://// path."
    )


def experiment_id(client, uri: str, name: str) -> str:
    """The id of experiment ``name``, created with an explicit artifact location when missing.

    Raises:
        TrackingError: the experiment exists but keeps its artifacts in Ray's temporary copy of a job's
            working folder (made by an earlier version), where Ray deletes them.
    """
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(name, artifact_location=artifact_location(uri))
    if RAY_COPY_MARK in experiment.artifact_location:
        raise TrackingError(
            f"MLflow experiment {name!r} keeps its artifacts in {experiment.artifact_location}, Ray's temporary copy "
            "of an earlier job's working folder, which Ray deletes. Choose a new tracking.experiment (its artifacts "
            "will go beside the store)."
        )
    return experiment.experiment_id


def metric_logger(uri: str | None, run_id: str | None, rank: int) -> Callable[[dict[str, float], int], None] | None:
    """A function logging ``{name: value}`` at a step to ``run_id``, on rank 0; ``None`` elsewhere or when off."""
    if run_id is None or rank != 0:
        return None
    import mlflow  # only once tracking is on: see the note at the top

    client = mlflow.MlflowClient(uri)

    def log(values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, float(v), now, step) for k, v in values.items()])

    return log


def set_tags(uri: str | None, run_id: str | None, tags: dict[str, str]) -> None:
    """Set tags on ``run_id`` (overwriting, so a resumed run may restate them); nothing when tracking is off."""
    if run_id is None:
        return
    import mlflow  # only once tracking is on: see the note at the top

    client = mlflow.MlflowClient(uri)
    for key, value in tags.items():
        client.set_tag(run_id, key, value[:5000])


def finish_run(args: TrackingArgs, run_id: str | None, artifacts: list[Path], status: str) -> None:
    """Upload ``artifacts`` (files or folders) and close the run as FINISHED or FAILED."""
    if run_id is None:
        return
    import mlflow  # only once tracking is on: see the note at the top

    client = mlflow.MlflowClient(tracking_uri(args))
    for path in artifacts:
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=path.name)
        elif path.exists():
            client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, status=status)
