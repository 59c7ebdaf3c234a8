"""Relative output paths under `ray job submit` go to a durable folder, or are refused with the fix."""

from pathlib import Path

import pytest

from raylora.config import ConfigError, load_config
from raylora.paths import anchor_inputs, anchor_outputs


@pytest.fixture
def ray_copy(tmp_path, monkeypatch):
    """Run in a folder shaped like Ray's temporary copy of a job's working folder."""
    folder = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    folder.mkdir(parents=True)
    monkeypatch.chdir(folder)
    monkeypatch.delenv("RAYLORA_BASE_DIR", raising=False)
    return folder


def test_relative_outputs_in_rays_copy_are_refused_with_both_fixes(ray_copy):
    cfg = load_config(None, ["train.output_dir=outputs/run", "data.output_dir=/abs/data"])
    with pytest.raises(ConfigError) as err:
        anchor_outputs(cfg, "train")
    problems = dict(err.value.problems)
    assert set(problems) == {"train.output_dir", "tracking.uri"}
    assert "train.output_dir=/abs/folder/outputs/run" in problems["train.output_dir"]
    assert str(ray_copy) in problems["train.output_dir"] and "RAYLORA_BASE_DIR" in problems["train.output_dir"]
    assert "tracking.uri=sqlite:////abs/folder/mlflow.db" in problems["tracking.uri"]


def test_base_dir_from_the_jobs_environment_anchors_every_output(ray_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLORA_BASE_DIR", str(tmp_path / "home"))
    with pytest.raises(ConfigError, match="is not a folder on this machine"):  # found by use: a typo went unnoticed
        anchor_outputs(load_config(None), "tune")
    (tmp_path / "home").mkdir()
    cfg = anchor_outputs(load_config(None, ["tracking.uri=sqlite:///runs/m.db"]), "tune")
    assert cfg.train.output_dir == str(tmp_path / "home" / "outputs/run")
    assert cfg.data.output_dir == str(tmp_path / "home" / "outputs/data")
    assert cfg.tracking.uri == f"sqlite:///{tmp_path}/home/runs/m.db"
    assert cfg.serve.adapter_root == "outputs/adapters"  # tune does not write there


def test_outside_a_job_paths_resolve_against_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYLORA_BASE_DIR", raising=False)
    cfg = anchor_outputs(load_config(None, ["tracking.enabled=false"]), "serve")
    assert Path(cfg.serve.adapter_root) == tmp_path / "outputs/adapters" and cfg.tracking.uri is None


def test_cli_exits_2_before_anything_runs(ray_copy, capsys):
    from raylora.cli import main

    assert main(["prepare", str(Path(__file__).parents[2] / "configs/tiny_lora_cpu.yaml")]) == 2
    assert "data.output_dir: 'outputs/tiny_lora_cpu/data' is relative" in capsys.readouterr().err
    assert not (ray_copy / "outputs").exists()


def test_absolute_outputs_in_rays_copy_pass_unchanged(ray_copy, tmp_path):
    """The refusal's first fix: a sweep submitted with absolute outputs and no RAYLORA_BASE_DIR runs as given."""
    cfg = load_config(None, [f"train.output_dir={tmp_path}/sweep", f"data.output_dir={tmp_path}/data",
                             f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])  # fmt: skip
    assert anchor_outputs(cfg, "tune") == cfg


def test_inputs_missing_from_rays_copy_are_read_from_the_base_folder(ray_copy, tmp_path, monkeypatch):
    """Found by use: the README's identity job read ../shared/data relative to Ray's copy, where it is not."""
    home = tmp_path / "home" / "repo"
    home.mkdir(parents=True)
    (home.parent / "shared").mkdir()
    (home.parent / "shared" / "identity.json").write_text("[]")
    (ray_copy / "data").mkdir()
    (ray_copy / "data" / "mine.jsonl").write_text("")
    sources = "data.sources=[{path: ../shared/identity.json}, {path: data/mine.jsonl}, {path: data/*.jsonl}]"
    cfg = load_config(None, [sources, "model.name_or_path=smollm2-135m-instruct", "export.adapter=../shared"])
    monkeypatch.setenv("RAYLORA_BASE_DIR", str(home))
    anchored = anchor_inputs(cfg)
    assert [s.path for s in anchored.data.sources] == [str(home / "../shared/identity.json"), "data/mine.jsonl",
                                                       "data/*.jsonl"]  # fmt: skip
    assert anchored.model.name_or_path == "smollm2-135m-instruct" and anchored.export.adapter == str(home / "../shared")
    monkeypatch.delenv("RAYLORA_BASE_DIR")
    assert anchor_inputs(cfg) == cfg  # without a base folder, nothing to read them from
