"""The scaling planner on known cases."""

import math

import pytest

from raylora.cli import main
from raylora.comm.plan import Link, collective_s, model_shapes, payload, predict
from raylora.config import load_config

LINK = Link(cards_per_node=8, intra_gbs=100.0, inter_gbs=10.0, intra_latency_us=0.0, inter_latency_us=0.0,
            peak_tflops=100.0)  # fmt: skip


def _cfg(*overrides):
    return load_config("configs/tiny_lora_cpu.yaml", list(overrides))


def test_payloads_come_from_the_model_and_lora_config():
    cfg = _cfg("lora.rank=4", "lora.target_modules=[q_proj,v_proj]")
    frozen, shapes = model_shapes(cfg)
    # tiny Llama: hidden 64, 2 layers, 4 heads and 2 KV heads of 16: q is 64 -> 64, v is 64 -> 32
    assert sorted(shapes) == sorted([(4, 64), (64, 4), (4, 64), (32, 4)] * 2)
    entries = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    assert payload(shapes, "none", cfg) == (4 * entries, "all_reduce")
    assert payload(shapes, "bf16", cfg) == (2 * entries, "all_reduce")
    assert payload(shapes, "topk", cfg) == (8 * round(0.01 * entries), "all_gather")
    assert payload(shapes, "sign", cfg) == (math.ceil(entries / 8) + 4 * 8, "all_gather")
    assert payload(shapes, "hadamard3", cfg) == ((3 * 128 // 8 + 2) * math.ceil(entries / 128), "all_gather")
    assert payload(shapes, "powersgd", cfg) == (4 * 2 * ((4 + 64) * 1 * 3 + (32 + 4) * 1), "all_reduce")
    assert frozen > 10 * entries


def test_ring_and_hierarchical_all_reduce_and_all_gather_costs():
    gb = 1e9
    assert collective_s(gb, "all_reduce", 1, LINK) == 0
    assert collective_s(gb, "all_reduce", 2, LINK) == pytest.approx(2 * 1 * (gb / 2) / 100e9)  # 2 (n-1)/n P / bw
    assert collective_s(gb, "all_reduce", 8, LINK) == pytest.approx(2 * 7 / 8 * gb / 100e9)
    # 4 nodes of 8: inside each node 2 (7/8) P / 100 GB/s, across nodes 2 (3/4) (P/8) / 10 GB/s
    assert collective_s(gb, "all_reduce", 32, LINK) == pytest.approx(2 * 7 / 8 * gb / 100e9 + 2 * 3 / 4 * gb / 8 / 10e9)
    assert collective_s(gb, "all_gather", 8, LINK) == pytest.approx(7 * gb / 100e9)
    assert collective_s(gb, "all_gather", 32, LINK) == pytest.approx(31 * gb / 10e9)


def test_prediction_is_perfect_on_one_card_and_compression_only_shrinks_communication():
    cfg = _cfg()
    rows = {(r["hook"], r["cards"]): r for r in predict(cfg, [1, 8, 64], LINK, mfu=0.5)}
    assert all(rows[h, 1]["efficiency"] == 1 for h in ("none", "fp16", "topk"))
    assert rows["none", 64]["efficiency"] < rows["none", 8]["efficiency"] < 1
    assert rows["fp16", 64]["comm_s"] == pytest.approx(rows["none", 64]["comm_s"] / 2)
    compute = rows["none", 8]["compute_s"]
    frozen, _ = model_shapes(cfg)
    assert compute == pytest.approx(4 * frozen * cfg.train.batch_size * cfg.data.cutoff_len / (100e12 * 0.5))


def test_raylora_plan_prints_the_table_and_writes_the_chart(tmp_path, capsys):
    out = tmp_path / "plan.png"
    code = main(["plan", "configs/tiny_lora_cpu.yaml", "--cards", "1,8,16", "--mfu", "0.3", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| 16 |" in text and "MFU 0.30 (given)" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", "configs/tiny_lora_cpu.yaml", "--cards", "8,x", "--mfu", "0.3"]) == 1
