"""MLflow experiments keep their artifacts beside the store, whatever the working folder."""

from pathlib import Path

import mlflow
import pytest

from raylora.config import TrackingArgs
from raylora.tracking import TrackingError, artifact_location, finish_run, start_run


def test_artifacts_go_beside_the_sqlite_store_not_the_working_folder(tmp_path, monkeypatch):
    elsewhere = tmp_path / "job"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = TrackingArgs(uri=f"sqlite:///{tmp_path}/store/mlflow.db", experiment="e")
    (tmp_path / "store").mkdir()
    (tmp_path / "a.txt").write_text("hello")
    run_id = start_run(args, "r", {"x": 1})
    finish_run(args, run_id, [tmp_path / "a.txt"], "FINISHED")
    assert (tmp_path / "store" / "mlartifacts" / run_id / "artifacts" / "a.txt").read_text() == "hello"
    assert not list(elsewhere.iterdir())


def test_artifact_location_per_store():
    assert artifact_location("sqlite:////data/m.db") == "file:///data/mlartifacts"
    assert artifact_location("http://127.0.0.1:5000") is None
    with pytest.raises(TrackingError, match="--artifacts-destination"):
        artifact_location("postgresql://u@h/db")


def test_an_experiment_whose_artifacts_live_in_rays_copy_is_refused(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    copy = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_1" / "mlruns"
    mlflow.MlflowClient(uri).create_experiment("old", artifact_location=Path(copy).as_uri())
    with pytest.raises(TrackingError, match="Choose a new tracking.experiment"):
        start_run(TrackingArgs(uri=uri, experiment="old"), "r", {})
