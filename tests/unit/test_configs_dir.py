from pathlib import Path

import pytest

from raylora.config import from_dict, load_config, to_dict

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {
        "tiny_lora_cpu.yaml", "smollm2_lora_cpu.yaml", "tiny_sweep_cpu.yaml", "smollm2_demo_cpu.yaml",
        "tiny_demo_cpu.yaml", "smollm2_serve_cpu.yaml", "smollm2_identity_sweep_cpu.yaml",
        "qwen2.5-7b_lora_npu_1x8.yaml", "qwen2.5-7b_lora_npu_4x8.yaml", "qwen2.5-7b_lora_cuda.yaml",
    }  # fmt: skip


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_says_how_to_run(path):
    cfg = load_config(path)
    assert from_dict(to_dict(cfg)) == cfg
    assert path.read_text().startswith("# Run: raylora ") and path.name in path.read_text().splitlines()[0]


@pytest.mark.parametrize(
    "name", ["tiny_sweep_cpu.yaml", "smollm2_identity_sweep_cpu.yaml", "smollm2_demo_cpu.yaml", "tiny_demo_cpu.yaml"]
)
def test_sweep_configs_pass_the_sweep_checks(name):
    from raylora.tune.space import check

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    check(cfg)
    assert {"lora.rank", "train.lr"} <= set(cfg.tune.space)


@pytest.mark.parametrize("name", ["smollm2_demo_cpu.yaml", "tiny_demo_cpu.yaml"])
def test_demo_configs_pass_the_demo_checks(name, tmp_path):
    import socket

    from raylora.demo import check_demo

    with socket.socket() as s:  # a free port: another server on this machine may hold the config's 8000
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_demo(load_config(Path(__file__).resolve().parents[2] / "configs" / name, [f"serve.port={port}"]))


@pytest.mark.parametrize("name", ["qwen2.5-7b_lora_npu_1x8.yaml", "qwen2.5-7b_lora_npu_4x8.yaml"])
def test_npu_configs_set_only_documented_hccl_variables(name):
    from raylora.backends.npu import hccl_env

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    env = hccl_env(cfg.backend)
    assert cfg.backend.device == "npu" and cfg.train.num_workers % 8 == 0
    assert set(env) <= {
        "HCCL_CONNECT_TIMEOUT",
        "HCCL_EXEC_TIMEOUT",
        "HCCL_BUFFSIZE",
        "HCCL_IF_IP",
        "HCCL_SOCKET_IFNAME",
    }
    assert 120 <= int(env["HCCL_CONNECT_TIMEOUT"]) <= 7200
