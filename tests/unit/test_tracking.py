"""MLflow experiments keep their artifacts beside the store, whatever the working folder."""

import contextlib
import sqlite3
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


def _schema(db: Path) -> list:
    """Tables, indexes and the migration a store is at; each statement's lines sorted (MLflow's own migrations write a
    table's constraints in an order that varies from one run to the next)."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        rows = c.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        version = c.execute("SELECT * FROM alembic_version").fetchall()
    return [
        (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines())) for kind, name, sql in rows
    ] + version


def test_a_new_store_is_a_copy_of_one_migrated_once_with_mlflows_own_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLORA_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflows.db").search_experiments()  # a store MLflow makes itself
    (tmp_path / "a").mkdir()
    first = start_run(TrackingArgs(uri=f"sqlite:///{tmp_path}/a/mlflow.db", experiment="e"), "r", {"x": 1})
    (template,) = (tmp_path / "cache" / "mlflow").iterdir()
    made = template.stat().st_mtime_ns
    (tmp_path / "b").mkdir()
    second = start_run(TrackingArgs(uri=f"sqlite:///{tmp_path}/b/mlflow.db", experiment="e"), "r", {"x": 2})
    assert template.stat().st_mtime_ns == made and list(template.parent.iterdir()) == [template]
    assert _schema(tmp_path / "a" / "mlflow.db") == _schema(tmp_path / "mlflows.db") == _schema(template)
    for folder, run_id, x in (("a", first, "1"), ("b", second, "2")):
        client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/{folder}/mlflow.db")
        assert client.get_run(run_id).data.params == {"x": x}
        # the Default experiment keeps its artifacts beside its store, as raylora's experiments do
        assert client.get_experiment("0").artifact_location == (tmp_path / folder / "mlartifacts" / "0").as_uri()
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_an_existing_store_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLORA_CACHE", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    old = mlflow.MlflowClient(uri).create_experiment("old", artifact_location=(tmp_path / "old").as_uri())
    run_id = start_run(TrackingArgs(uri=uri, experiment="old"), "r", {})
    assert mlflow.MlflowClient(uri).get_run(run_id).info.experiment_id == old
    assert not (tmp_path / "cache").exists()
