import subprocess
import sys

import pytest

from raylora.cli import COMMANDS, main


def test_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "raylora.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("prepare", "train", "tune", "export", "serve", "doctor", "quickstart"):
        assert name in out and COMMANDS[name][:30] in out


def test_the_command_line_imports_no_layer_for_its_errors_and_each_layers_error_says_its_exit_code():
    """main() imported every layer (torch, transformers, peft, Ray Data) for the error classes of every command; it
    now tells them apart by their kind (raylora.errors), and each command imports only its own layers."""
    from raylora.backends import BackendError
    from raylora.data.sources import DataError
    from raylora.demo import DemoError
    from raylora.errors import BadInput, RunFailed
    from raylora.model_files import ModelError
    from raylora.serve.launch import ServeSetupError
    from raylora.tracking import TrackingError
    from raylora.train.checkpoint import CheckpointError
    from raylora.train.fit import TrainingError

    code = "import json, sys, raylora.cli, raylora.demo\nprint(json.dumps(sorted(m for m in ('torch', 'transformers', " \
           "'peft', 'ray.data') if m in sys.modules)))"  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    assert all(issubclass(e, BadInput) for e in (BackendError, DataError, ModelError, ServeSetupError, CheckpointError))
    assert all(issubclass(e, RunFailed) for e in (DemoError, TrackingError, TrainingError))


def test_tune_without_a_search_space_exits_2_before_anything_starts(tmp_path, capsys):
    assert main(["tune", "configs/tiny_lora_cpu.yaml", f"train.output_dir={tmp_path}/sweep"]) == 2
    assert "tune.space: is empty" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_bad_config_lists_all_problems_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("lora: {rnak: 8, dropout: 2}\ntrain: {max_steps: ten}\n")
    assert main(["quickstart", str(path), "backend.device=gpu"]) == 2
    err = capsys.readouterr().err
    assert "has 4 problems" in err
    for fragment in ("lora.rnak", "did you mean 'rank'", "lora.dropout", "train.max_steps", "backend.device", "'gpu'"):
        assert fragment in err


def test_doctor_prints_the_table_and_passes_here(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for item in ("python", "torch", "ray", "peft", "transformers", "mlflow", "torch_npu", "CANN", "device",
                 "dist backend", "ray cluster", "mlflow tracking uri"):  # fmt: skip
        assert f"\n{item} " in out or out.startswith(item)
    assert "gloo" in out and "OK: this environment can run a raylora job." in out


def test_doctor_fails_with_the_fix_when_the_device_is_missing(capsys):
    assert main(["doctor", "configs/tiny_lora_cpu.yaml", "backend.device=npu"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: backend.device=npu was asked for" in out and "pip install 'raylora[npu]'" in out


def test_doctor_flags_an_unreachable_ray_address(monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "127.0.0.1:1 UNREACHABLE" in out and "ray start --head --node-ip-address=127.0.0.1" in out


def test_doctor_cluster_without_a_cluster_says_how_to_start_one(monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert main(["doctor", "--cluster"]) == 1
    out = capsys.readouterr().out
    assert "\ncluster nodes " in out and "PROBLEM: raylora doctor --cluster inspects a running Ray cluster" in out


def test_doctor_warns_of_compile_on_npu(capsys):
    main(["doctor", "configs/tiny_lora_cpu.yaml", "backend.device=npu", "train.compile=true"])
    rows = [line.split(None, 1) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert ["train.compile", "WARNING: train.compile on NPU compiles through TorchAir, which its own guide calls a "
            "beta feature aimed at inference; raylora has not run it on an NPU: keep train.compile=false unless you "
            "have measured it"] in rows  # fmt: skip
    assert main(["doctor", "configs/tiny_lora_cpu.yaml", "train.compile=true"]) == 0
    assert "WARNING" not in capsys.readouterr().out


def test_model_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    rc = main(["quickstart", "configs/tiny_lora_cpu.yaml", f"model.name_or_path={tmp_path}/missing",
               f"train.output_dir={tmp_path}/out"])  # fmt: skip
    assert rc == 2  # bad input, as a bad config
    err = capsys.readouterr().err
    assert err.startswith("raylora quickstart: model.name_or_path:") and "Traceback" not in err


def test_serve_lists_every_problem_before_touching_ray(tmp_path, capsys):
    (tmp_path / "root").write_text("not a folder")
    args = ["serve", "configs/tiny_serve_cpu.yaml", "serve.quantization=w8a8-smoothquant", "data.sources=[]",
            f"serve.adapter_root={tmp_path / 'root'}"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "calibrates on data.sources" in err and "is a file" in err
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_missing_data_file_is_reported_before_touching_ray(command, tmp_path, capsys):
    """A typo in a data path fails in a second, not after starting a cluster (Ray is never started here)."""
    config = "configs/tiny_sweep_cpu.yaml" if command == "tune" else "configs/tiny_lora_cpu.yaml"
    args = [command, config, f"data.sources=[{{path: {tmp_path}/nope.jsonl}}]", f"train.output_dir={tmp_path}/out"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/nope.jsonl matches no data file" in err
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize("command", ["train", "tune"])
@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("lora.target_modules=[q_proj, wq]", "wq match no Linear layer of LlamaForCausalLM"),
        ("model.name_or_path={tmp}/missing", "model.name_or_path: {tmp}/missing does not exist"),
    ],
)
def test_a_mistyped_model_or_layer_name_is_reported_before_touching_ray(command, override, said, tmp_path, capsys):
    """Found by use: both failed inside the job, after a cluster had started (the layer name in the Ray Train
    worker, with its traceback printed by every actor that saw it)."""
    config = "configs/tiny_sweep_cpu.yaml" if command == "tune" else "configs/tiny_lora_cpu.yaml"
    args = [command, config, override.format(tmp=tmp_path), f"train.output_dir={tmp_path}/out"]
    assert main(args) == 2  # bad input, from either command (train said 1: found by use)
    err = capsys.readouterr().err
    assert said.format(tmp=tmp_path) in err and "Traceback" not in err
    import ray

    assert not ray.is_initialized()


def test_a_data_path_model_and_layer_all_mistyped_are_listed_together(tmp_path, capsys):
    """Found by use: each took another run (9-18 s each) to learn of."""
    args = ["train", "configs/tiny_lora_cpu.yaml", f"data.sources=[{{path: {tmp_path}/nope.jsonl}}]",
            f"model.name_or_path={tmp_path}/missing", f"train.output_dir={tmp_path}/out"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the job has 2 problems:" in err and "  - data.sources: " in err and "  - model: model.name_or_path" in err
    import ray

    assert not ray.is_initialized()


def test_overrides_may_follow_a_flag(tmp_path, capsys):
    """Found by use: `raylora tune CONFIG --resume train.output_dir=...` was refused as unrecognized arguments."""
    assert main(["tune", "configs/tiny_sweep_cpu.yaml", "--resume", f"train.output_dir={tmp_path}/sweep"]) == 2
    assert f"no sweep to resume in {tmp_path}/sweep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "configs/tiny_sweep_cpu.yaml", "--resume", "--frobnicate"])


def test_serve_detach_refuses_a_cluster_that_would_end_with_it(monkeypatch, capsys):
    """Found by use: it printed "is ready" and exited 0, and its own cluster, with the app, ended with it."""
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert main(["serve", "configs/tiny_serve_cpu.yaml", "--detach"]) == 2
    assert "--detach returns at once" in capsys.readouterr().err
    import ray

    assert not ray.is_initialized()


def test_serve_reports_a_missing_calibration_file_before_touching_ray(tmp_path, capsys):
    args = ["serve", "configs/tiny_serve_cpu.yaml", "serve.quantization=w8a8-smoothquant",
            f"data.sources=[{{path: {tmp_path}/nope.json}}]"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "calibrates on data.sources, which has data problems" in err and f"{tmp_path}/nope.json matches no" in err
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("tune.search=optuna", "tune.search: optuna is not installed; pip install optuna"),
        ("tune.space={lora.rank: {choise: [4]}}", "tune.space.lora.rank: unknown distribution 'choise'"),
    ],
)
def test_doctor_reports_what_the_sweep_checks_refuse(override, said, monkeypatch, capsys):
    """Found by use: doctor said OK for sweeps that `raylora tune` refuses at once."""
    from raylora.tune import space

    real = space.importlib.util.find_spec
    monkeypatch.setattr(space.importlib.util, "find_spec", lambda name: None if name == "optuna" else real(name))
    assert main(["doctor", "configs/tiny_sweep_cpu.yaml", override]) == 1
    assert f"PROBLEM: {said}" in capsys.readouterr().out


def test_doctor_reports_a_tracking_server_that_does_not_answer(capsys):
    """Found by use: doctor said OK, and the job then failed on it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    uri = f"http://127.0.0.1:{port}"
    assert main(["doctor", "configs/tiny_sweep_cpu.yaml", f"tracking.uri={uri}"]) == 1
    out = capsys.readouterr().out
    assert f"{uri} UNREACHABLE" in out and f"PROBLEM: the MLflow tracking server {uri} does not answer" in out
    assert main(["doctor", "configs/tiny_sweep_cpu.yaml", f"tracking.uri={uri}", "tracking.enabled=false"]) == 0
    assert main(["doctor", "configs/tiny_sweep_cpu.yaml"]) == 0  # the shipped sweep, its SQLite store
