"""What a rerun of a training job does before any cluster or worker starts, from the checkpoints it left."""

import json

import pytest
from peft import LoraConfig, get_peft_model

from raylora import runs
from raylora.config import load_config, to_dict
from raylora.models import tiny_model
from raylora.train import fit as fit_module
from raylora.train.checkpoint import LORA_SHAPE, CheckpointError, newest


def _checkpoint(out, name: str, step: int, cfg, rank: int) -> None:
    folder = out / "ray" / name
    get_peft_model(tiny_model("llama"), LoraConfig(r=rank, target_modules=["q_proj"])).save_pretrained(
        folder / "adapter"
    )
    lora = {k: to_dict(cfg.lora)[k] for k in LORA_SHAPE} | {"rank": rank}
    (folder / "meta.json").write_text(json.dumps({"model": cfg.model.name_or_path, "lora": lora, "step": step}))
    (folder / "history.json").write_text(json.dumps([{"step": s, "loss": 5.0 - s / 10} for s in range(1, step + 1)]))
    (folder / "state.pt").write_bytes(b"")


def _job_run(cfg, out):
    """The job's MLflow run, as :func:`raylora.train.fit.fit` asks for it."""
    return runs.job_run(cfg, out, newest(out) is not None)


def _config(tmp_path, *overrides):
    return load_config("configs/tiny_lora_cpu.yaml", [f"train.output_dir={tmp_path / 'run'}", *overrides])


def test_a_finished_job_rerun_trains_nothing_and_records_no_run(tmp_path, monkeypatch):
    """Found by use: it started the cluster and the workers, trained nothing, and logged an empty MLflow run."""
    cfg = _config(tmp_path, "train.max_steps=6")
    out = tmp_path / "run"
    _checkpoint(out, "checkpoint_2026-01-01_00-00-01", 4, cfg, cfg.lora.rank)
    _checkpoint(out, "checkpoint_2026-01-01_00-00-02", 6, cfg, cfg.lora.rank)
    monkeypatch.setattr(fit_module, "ensure_ray", lambda: pytest.fail("the cluster was touched"))
    monkeypatch.setattr(runs, "start_run", lambda *a: pytest.fail("an MLflow run was opened"))
    said = []
    result = fit_module.fit(cfg, log=said.append)
    assert result["steps"] == 6 and result["run_id"] is None and result["loss"] == pytest.approx(4.4)
    assert "nothing to train" in said[0] and "train.max_steps=6" in said[0]
    assert (out / "adapter" / "adapter_config.json").is_file() and len(
        json.loads((out / "history.json").read_text())
    ) == 6


def test_a_checkpoint_of_another_lora_shape_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    """Found by use: the refusal came from the worker, after Ray Train had started the worker group three times."""
    cfg = _config(tmp_path, "train.max_steps=10")
    _checkpoint(tmp_path / "run", "checkpoint_2026-01-01_00-00-01", 4, cfg, cfg.lora.rank * 2)
    monkeypatch.setattr(fit_module, "ensure_ray", lambda: pytest.fail("the cluster was touched"))
    with pytest.raises(CheckpointError, match="lora.rank"):
        fit_module.fit(cfg)


def test_a_resumed_job_continues_its_mlflow_run_or_links_a_new_one(tmp_path):
    """Found by use: every resumed invocation was a new MLflow run with nothing linking it to the earlier ones."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _config(tmp_path, "train.max_steps=6", "tracking.enabled=true", f"tracking.uri={uri}")
    out = tmp_path / "run"
    out.mkdir()
    first = _job_run(cfg, out)  # nothing to resume: a new run
    client = mlflow.MlflowClient(uri)
    client.set_terminated(first, "FAILED")  # the driver died
    _checkpoint(out, "checkpoint_2026-01-01_00-00-01", 4, cfg, cfg.lora.rank)
    assert _job_run(cfg, out) == first  # the same settings resume the same run
    assert client.get_run(first).info.status == "RUNNING"
    more = _config(tmp_path, "train.max_steps=8", "tracking.enabled=true", f"tracking.uri={uri}")
    second = _job_run(more, out)  # other settings: a new run that names the one it continues
    assert second != first and client.get_run(second).data.tags["raylora.continues_run"] == first
    assert client.get_run(second).data.params["train.max_steps"] == "8"
    assert _job_run(more, out) == second
    client.delete_run(second)  # deleted in the MLflow UI: a new run, not a failed reopen
    third = _job_run(more, out)
    assert third not in (first, second) and client.get_run(third).info.status == "RUNNING"


def test_a_checkpoint_ray_had_not_registered_is_resumed_from_and_dropped_after_the_run(tmp_path):
    """Found by use: a run stopped (Ctrl-C, SIGTERM, a killed worker) within Ray's poll of a checkpoint resumed from
    the one before, training its steps again, and the unregistered folder stayed past train.keep_checkpoints."""
    from raylora.train.checkpoint import drop_unregistered, resume_point

    cfg = _config(tmp_path)
    out = tmp_path / "run"
    _checkpoint(out, "checkpoint_a", 15, cfg, cfg.lora.rank)
    handed = out / "ray" / "checkpoint_a"
    assert resume_point(handed, out) == handed and resume_point(None, out) == handed
    _checkpoint(out, "checkpoint_b", 20, cfg, cfg.lora.rank)
    (out / "ray" / "checkpoint_b" / "state.pt").unlink()  # not written yet: not complete
    assert resume_point(handed, out) == handed
    (out / "ray" / "checkpoint_b" / "meta.json").write_text('{"mod')  # cut short as its writer was killed
    (out / "ray" / "checkpoint_b" / "state.pt").write_bytes(b"")
    assert resume_point(handed, out) == handed
    _checkpoint(out, "checkpoint_b", 20, cfg, cfg.lora.rank)
    assert resume_point(handed, out) == out / "ray" / "checkpoint_b"
    assert resume_point(None, out) == out / "ray" / "checkpoint_b"
    _checkpoint(out, "checkpoint_c", 25, cfg, cfg.lora.rank)
    snapshot = {
        "checkpoint_results": [{"checkpoint_dir_name": "checkpoint_a"}, {"checkpoint_dir_name": "checkpoint_c"}]
    }
    (out / "ray" / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    assert drop_unregistered(out) == ["checkpoint_b"]
    assert sorted(p.name for p in (out / "ray").glob("checkpoint_*") if p.is_dir()) == ["checkpoint_a", "checkpoint_c"]
    assert drop_unregistered(tmp_path / "never-ran") == []


def test_a_finished_job_rerun_with_other_settings_keeps_the_adapters_config(tmp_path, monkeypatch):
    """Found by use: rerunning with train.lr=0.5 wrote lr 0.5 into config.yaml beside an adapter trained at 0.01."""
    cfg = _config(tmp_path, "train.max_steps=6")
    out = tmp_path / "run"
    _checkpoint(out, "checkpoint_x", 6, cfg, cfg.lora.rank)
    fit_module.fit(cfg, log=lambda _: None)
    first = (out / "config.yaml").read_text()
    fit_module.fit(_config(tmp_path, "train.max_steps=6", "train.lr=0.5"), log=lambda _: None)
    assert (out / "config.yaml").read_text() == first and "lr: 0.5" not in first


def _agree(rank: int, out: str) -> None:
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from raylora.train.loop import agreed

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    folders = Path(out) / "run" / "ray"
    handed, newer = folders / "checkpoint_a", folders / "checkpoint_b"
    same = agreed(newer, handed, torch.device("cpu"))
    differ = agreed(newer if rank == 0 else handed, handed, torch.device("cpu"))  # rank 1 does not see the newer
    (Path(out) / f"agreed{rank}.json").write_text(json.dumps([same.name, differ.name]))
    dist.barrier()
    os._exit(0)  # as the other gloo tests: no finalisation that could free the group on one rank first


def test_ranks_resume_from_the_same_checkpoint_or_all_from_the_handed_one(tmp_path):
    from ranks import run_two_ranks

    cfg = _config(tmp_path)
    out = tmp_path / "run"
    _checkpoint(out, "checkpoint_a", 15, cfg, cfg.lora.rank)
    _checkpoint(out, "checkpoint_b", 20, cfg, cfg.lora.rank)
    run_two_ranks(_agree, str(tmp_path))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"agreed{rank}.json").read_text()) == ["checkpoint_b", "checkpoint_a"]
