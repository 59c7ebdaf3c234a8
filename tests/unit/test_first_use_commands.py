"""On a machine that never ran raylora, every command resolves (and on first use converts) the default model before
any meta-device context: transformers refuses ``from_pretrained`` under ``torch.device("meta")``.

The conversion itself costs about 20 s on 2 cores, so it runs once, in ``tests/integration/test_first_conversion.py``; here a
spy stands in for it, records the device that new tensors would land on when it is reached, and stops the command.
"""

import runpy
import sys
from pathlib import Path

import pytest
import torch

from raylora import model_files
from raylora.cli import main
from raylora.model_files import ModelError

ROOT = Path(__file__).resolve().parents[2]


class Reached(ModelError):
    """The spy's stop: a ModelError, so each command reports it as it reports a missing model (exit 2)."""


@pytest.fixture
def conversion_spy(monkeypatch, tmp_path):
    """An empty model cache, and a conversion that records where new tensors would go, then stops the command."""
    monkeypatch.setenv("RAYLORA_CACHE", str(tmp_path / "empty-cache"))
    seen: list[str] = []

    def spy(gguf, folder):
        seen.append(torch.empty(()).device.type)
        raise Reached(f"conversion of {gguf.name} reached")

    monkeypatch.setattr(model_files, "gguf_to_cache", spy)
    return seen


COMMANDS = {
    "train": ["train", "configs/smollm2_lora_cpu.yaml"],
    "tune": ["tune", "configs/smollm2_identity_sweep_cpu.yaml"],
    "plan": ["plan", "configs/smollm2_lora_cpu.yaml", "--mfu", "0.4"],
    "demo": ["demo", "configs/smollm2_demo_cpu.yaml", "serve.port=1"],
    "doctor": ["doctor", "configs/smollm2_identity_sweep_cpu.yaml"],
    "prepare": ["prepare", "configs/smollm2_prepare_cpu.yaml"],
    "serve": ["serve", "configs/smollm2_serve_cpu.yaml", "serve.port=1"],
    "quickstart": ["quickstart", "configs/smollm2_lora_cpu.yaml"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_reaches_the_default_models_first_conversion_outside_the_meta_device(
    command, conversion_spy, tmp_path, monkeypatch
):
    monkeypatch.chdir(ROOT)
    outputs = [f"train.output_dir={tmp_path}/run", f"data.output_dir={tmp_path}/data"]
    main([*COMMANDS[command], *outputs])
    assert conversion_spy, f"raylora {command} never asked for the default model's folder"
    assert conversion_spy[0] == "cpu", f"raylora {command} converted the model under the {conversion_spy[0]} device"


@pytest.mark.parametrize("job", sorted(p.name for p in (ROOT / "jobs").glob("*.py")))
def test_each_job_script_is_the_cli_command_of_its_name(job, monkeypatch):
    """The jobs/ scripts run the command of their name through :func:`raylora.cli.main`, so its pre-flight too."""
    calls = []
    monkeypatch.setattr("raylora.cli.main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setattr(sys, "argv", [job, "configs/x.yaml", "train.max_steps=3"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "jobs" / job), run_name="__main__")
    assert done.value.code == 0
    (argv,) = calls
    assert argv[0] == job.removesuffix(".py") and argv[-2:] == ["configs/x.yaml", "train.max_steps=3"]
