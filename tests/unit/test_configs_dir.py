from pathlib import Path

import pytest

from raylora.config import from_dict, load_config, to_dict

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"tiny_lora_cpu.yaml", "smollm2_lora_cpu.yaml", "tiny_sweep_cpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_says_how_to_run(path):
    cfg = load_config(path)
    assert from_dict(to_dict(cfg)) == cfg
    assert path.read_text().startswith("# Run: raylora ") and path.name in path.read_text().splitlines()[0]


@pytest.mark.parametrize("name", ["tiny_sweep_cpu.yaml", "smollm2_identity_sweep_cpu.yaml"])
def test_sweep_configs_pass_the_sweep_checks(name):
    from raylora.tune.space import check

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    check(cfg)
    assert {"lora.rank", "lora.alpha", "train.lr"} <= set(cfg.tune.space)
