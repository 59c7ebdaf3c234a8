"""A resumed sweep is checked against its MLflow store before any cluster is touched."""

import json

import mlflow
import pytest

from raylora.config import ConfigError, load_config
from raylora.tune import sweep as sweep_module


def test_resume_against_another_mlflow_store_is_refused_before_ray(tmp_path, root, monkeypatch):
    monkeypatch.chdir(root)
    monkeypatch.setattr(sweep_module, "ensure_ray", lambda: pytest.fail("the cluster was touched"))
    started = f"sqlite:///{tmp_path / 'first.db'}"
    client = mlflow.MlflowClient(started)
    run_id = client.create_run(client.create_experiment("tiny-sweep")).info.run_id
    out = tmp_path / "sweep"
    (out / "tune").mkdir(parents=True)
    (out / "sweep.json").write_text(json.dumps({"parent_run_id": run_id}))
    other = f"sqlite:///{tmp_path / 'other.db'}"
    cfg = load_config(root / "configs/tiny_sweep_cpu.yaml", [f"train.output_dir={out}", f"tracking.uri={other}"])
    with pytest.raises(ConfigError) as err:
        sweep_module.sweep(cfg, resume=True, log=lambda _: None)
    ((key, message),) = err.value.problems
    assert key == "tracking.uri" and run_id in message and other in message
    assert not (tmp_path / "other.db").exists()  # refused without creating an empty store
    client.delete_run(run_id)  # deleted in the MLflow UI
    cfg = load_config(root / "configs/tiny_sweep_cpu.yaml", [f"train.output_dir={out}", f"tracking.uri={started}"])
    with pytest.raises(ConfigError, match="was deleted"):
        sweep_module.sweep(cfg, resume=True, log=lambda _: None)


def test_a_trial_restarting_from_step_0_gets_a_new_child_run(tmp_path, root, monkeypatch):
    """Found by use: a trial stopped before its first checkpoint trained again from step 0 into the same child run,
    whose curves then repeated steps 2, 4, 6."""
    from raylora.runs import child_run

    monkeypatch.chdir(root)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(root / "configs/tiny_sweep_cpu.yaml", [f"tracking.uri={uri}"])
    client = mlflow.MlflowClient(uri)
    parent = client.create_run(client.create_experiment("s")).info.run_id
    out = tmp_path / "trial"
    out.mkdir()
    first = child_run(cfg, out, parent, "t0", {"train.lr": 0.01}, resumes=False)
    second = child_run(cfg, out, parent, "t0", {"train.lr": 0.01}, resumes=False)  # again from step 0
    assert second != first and client.get_run(first).info.status == "KILLED"
    assert client.get_run(second).data.tags["raylora.replaces_run"] == first
    assert child_run(cfg, out, parent, "t0", {"train.lr": 0.01}, resumes=True) == second  # from its checkpoint


def test_resume_with_other_settings_is_refused_before_ray(tmp_path, root, monkeypatch):
    """Found by use: --resume without the sweep's overrides trained new trials for another budget, called the
    interrupted ones completed, and picked a best across them."""
    from raylora.config import to_record
    from raylora.runs import flatten

    monkeypatch.chdir(root)

    class Touched(Exception):
        pass

    def touched():
        raise Touched

    monkeypatch.setattr(sweep_module, "ensure_ray", touched)
    out = tmp_path / "sweep"
    (out / "tune").mkdir(parents=True)
    started = [f"train.output_dir={out}", "tracking.enabled=false", "tune.scheduler=none", "train.max_steps=16"]
    first = load_config(root / "configs/tiny_sweep_cpu.yaml", started)
    (out / "sweep_config.json").write_text(json.dumps(flatten(to_record(first)), default=str))
    forgot = load_config(root / "configs/tiny_sweep_cpu.yaml", [f"train.output_dir={out}", "tracking.enabled=false"])
    with pytest.raises(ConfigError) as err:
        sweep_module.sweep(forgot, resume=True, log=lambda _: None)
    problems = dict(err.value.problems)
    assert set(problems) == {"train.max_steps", "tune.scheduler", "--resume"}
    assert problems["train.max_steps"] == f"the sweep started with 16, this command gives {forgot.train.max_steps}"
    # the same trial settings pass on to the cluster, whatever the concurrency, retries or the data files' folder
    same = [
        *started,
        "tune.max_concurrent=1",
        "train.max_failures=3",
        f"data.sources=[{{path: {root}/data/raylora_identity.jsonl}}]",
    ]
    with pytest.raises(Touched):
        sweep_module.sweep(load_config(root / "configs/tiny_sweep_cpu.yaml", same), resume=True, log=lambda _: None)
