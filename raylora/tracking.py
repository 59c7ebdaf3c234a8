"""MLflow tracking: where runs are stored."""

from __future__ import annotations

from pathlib import Path

from raylora.config import TrackingArgs


def tracking_uri(args: TrackingArgs) -> str:
    """``tracking.uri`` if set, else an absolute SQLite file ``mlflow.db`` in the working folder.

    The path is made absolute here, on the driver, because MLflow resolves a relative SQLite path
    against each process's own working folder, and Ray workers run elsewhere.
    """
    return args.uri or f"sqlite:///{Path('mlflow.db').resolve()}"
