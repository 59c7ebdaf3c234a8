from pathlib import Path

import pytest

from raylora.config import from_dict, load_config, to_dict

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"tiny_lora_cpu.yaml", "smollm2_lora_cpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_says_how_to_run(path):
    cfg = load_config(path)
    assert from_dict(to_dict(cfg)) == cfg
    assert path.read_text().startswith("# Run: raylora ") and path.name in path.read_text().splitlines()[0]
