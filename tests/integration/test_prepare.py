import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from raylora.config import load_config
from raylora.data.encode import IGNORE_INDEX
from raylora.data.pipeline import DataError, build_dataset, plan_sources, prepare
from raylora.model_files import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("ray_session")
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def shards(out: Path, split: str) -> list[dict]:
    return pads.dataset(str(out / "shards" / f"split={split}"), format="parquet").to_table().to_pylist()


@pytest.fixture
def mixed(tmp_path):
    """Four formats in four file types, with one bad row of each kind a reader can meet."""
    alpaca = [{"instruction": f"Say {i}.", "input": "", "output": f"{i} from {{{{name}}}}"} for i in range(30)]
    lines = [json.dumps(r) for r in alpaca]
    lines[3] = json.dumps({"instruction": "no answer"})
    lines[7] = json.dumps({"instruction": "blank", "output": "  "})
    lines[9] = '{"instruction": broken'
    (tmp_path / "alpaca.jsonl").write_bytes(
        ("\n".join(lines) + "\n").encode() + b'{"instruction": "\xff", "output": "x"}\n'
    )
    share = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(10)
    ]
    share[4]["conversations"][1]["from"] = "robot"
    (tmp_path / "share.json").write_text(
        "[\n" + ",\n".join(json.dumps(r) for r in share) + "\n]\n"
    )  # row i on line i + 2
    msgs = [[{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"v{i}"}] for i in range(10)]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    (tmp_path / "text.csv").write_text("text\n" + "".join(f"document number {i}\n" for i in range(10)))
    return tmp_path


def config(tmp_path, data_dir, *overrides):
    return load_config(
        None,
        [
            f"data.sources=[{{path: {data_dir}/alpaca.jsonl}}, {{path: {data_dir}/share.json}}, "
            f"{{path: {data_dir}/chat.parquet, weight: 2}}, {{path: {data_dir}/text.csv, format: text}}]",
            "data.placeholders.name=Ray", "data.cutoff_len=64", "data.eval_fraction=0.2",
            f"data.output_dir={tmp_path}/out", "model.name_or_path=tiny-llama", "data.max_reject_fraction=0.2",
            *overrides,
        ],
    )  # fmt: skip


def test_prepare_mixes_formats_rejects_bad_rows_and_packs(tmp_path, mixed):
    cfg = config(tmp_path, mixed)
    summary = prepare(cfg, log=lambda s: None)
    out = tmp_path / "out"
    assert (summary["rows_read"], summary["rows_rejected"], summary["rows_kept"]) == (61, 5, 56)
    assert summary["examples"] == 56 + 10  # chat.parquet has weight 2

    rejects = {
        (Path(r["source"]).name, r["line"]): r["reason"]
        for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())
    }
    assert rejects == {
        ("alpaca.jsonl", 4): "field 'output' is missing, expected a string",
        ("alpaca.jsonl", 8): "empty response",
        ("alpaca.jsonl", 10): "not valid JSON (Expecting value)",
        ("alpaca.jsonl", 31): "undecodable text (not UTF-8: invalid start byte at byte 17)",
        (
            "share.json",
            6,
        ): "unknown role 'robot'; expected one of 'human', 'gpt', 'system', 'function_call', 'observation' (data.sources[].columns)",
    }
    train, evals = shards(out, "train"), shards(out, "eval")
    assert summary["splits"]["train"]["examples"] + summary["splits"]["eval"]["examples"] == 66
    assert 0 < len(evals) and summary["splits"]["eval"]["examples"] < 30
    tok = tiny_tokenizer()
    texts = []
    for pack in train + evals:
        assert sum(pack["seq_lens"]) == len(pack["input_ids"]) == pack["num_tokens"] <= 64
        start = 0
        for n in pack["seq_lens"]:
            assert pack["position_ids"][start : start + n] == list(range(n))
            assert pack["labels"][start] == IGNORE_INDEX
            texts.append(tok.decode(pack["input_ids"][start : start + n]))
            start += n
    assert sum("12 from Ray" in t for t in texts) == 1
    assert sum("<|im_start|>user\nu3<|im_end|>" in t for t in texts) == 2
    assert sum(t == "document number 5<|im_end|>" for t in texts) == 1
    assert sum("<|im_start|>assistant\na7<|im_end|>" in t for t in texts) == 1
    assert (
        summary["packing_efficiency"] > 0.6
    )  # packs fill within each file: four tiny files leave four part-full tails
    row_group = pq.ParquetFile(next((out / "shards").rglob("*.parquet"))).metadata.row_group(0)
    columns = [row_group.column(k) for k in range(row_group.num_columns)]
    assert {c.compression for c in columns} == {"ZSTD"} and not any(c.has_dictionary_page for c in columns)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and set(manifest["fingerprint"]["files"]) == set(plan_sources(cfg.data))
    assert manifest["fingerprint"]["template"]["name"] == "tokenizer"


def test_second_run_reuses_shards_until_an_input_changes(tmp_path, mixed):
    cfg = config(tmp_path, mixed)
    first = prepare(cfg, log=lambda s: None)
    shard_files = sorted((tmp_path / "out" / "shards").rglob("*.parquet"))
    messages = []
    again = prepare(cfg, log=messages.append)
    assert again["reused"] and again["rows_read"] == first["rows_read"]
    assert "reusing" in messages[0] and sorted((tmp_path / "out" / "shards").rglob("*.parquet")) == shard_files

    with (mixed / "text.csv").open("a") as f:
        f.write("one more document\n")
    third = prepare(cfg, log=lambda s: None)
    assert "reused" not in third and third["rows_read"] == first["rows_read"] + 1
    changed = prepare(config(tmp_path, mixed, "data.cutoff_len=128"), log=lambda s: None)
    assert "reused" not in changed


def test_split_is_deterministic_and_eval_count_exact(tmp_path, mixed):
    a = prepare(config(tmp_path / "a", mixed, "data.seed=3"), log=lambda s: None)
    b = prepare(config(tmp_path / "b", mixed, "data.seed=3"), log=lambda s: None)
    assert shards(tmp_path / "a" / "out", "eval") == shards(tmp_path / "b" / "out", "eval")
    assert a["splits"] == {k: {**v, "shards": v["shards"].replace("/b/", "/a/")} for k, v in b["splits"].items()}
    only_text = f"data.sources=[{{path: {mixed}/text.csv, format: text}}]"
    counted = prepare(
        config(tmp_path / "c", mixed, only_text, "data.eval_fraction=0", "data.eval_count=7", "data.packing=false"),
        log=lambda s: None,
    )
    assert counted["splits"]["eval"]["examples"] == 7 and counted["splits"]["train"]["examples"] == 3
    assert counted["splits"]["eval"]["packs"] == 7  # no packing: one example per sequence
    every = config(tmp_path / "d", mixed, only_text, "data.eval_fraction=0", "data.eval_count=10")
    with pytest.raises(DataError, match=r"data.eval_count=10 would hold out every row: the sources have 10"):
        prepare(every, log=lambda s: None)  # found by use: exit 0 with 0 training examples


def test_two_copies_of_a_file_are_both_trained_and_a_broken_array_is_named_plainly(tmp_path, mixed):
    """Found by use: the copies wrote the same shard names (named by content), so half the data was gone, the summary
    counting it all; a .json array broken past its first row ended with Ray's task traceback."""
    (tmp_path / "copies").mkdir()
    for name in ("one.jsonl", "two.jsonl"):
        (tmp_path / "copies" / name).write_bytes((mixed / "alpaca.jsonl").read_bytes())
    only = f"data.sources=[{{path: {tmp_path}/copies}}]"
    summary = prepare(config(tmp_path / "a", mixed, only, "data.eval_fraction=0"), log=lambda s: None)
    examples = sum(len(p["seq_lens"]) for p in shards(tmp_path / "a" / "out", "train"))
    assert examples == summary["splits"]["train"]["examples"] == 2 * 27  # 31 rows, 4 rejected, in each copy
    rows = [json.dumps({"instruction": f"q{i}", "output": "a"}) for i in range(3)]
    (tmp_path / "broken.json").write_text("[\n" + ",\n".join(rows[:2]) + ',\n{"instruction": "x",}\n]\n')
    with pytest.raises(DataError) as err:
        prepare(config(tmp_path / "b", mixed, f"data.sources=[{{path: {tmp_path}/broken.json}}]"), log=lambda s: None)
    assert str(err.value).startswith(f"{tmp_path}/broken.json: not valid JSON at line 4")


def test_too_many_rejects_fail_after_writing_them(tmp_path, mixed):
    with pytest.raises(DataError, match=r"5 of 61 rows were rejected, more than data.max_reject_fraction=0.05"):
        prepare(config(tmp_path, mixed, "data.max_reject_fraction=0.05"), log=lambda s: None)
    assert len((tmp_path / "out" / "rejects.jsonl").read_text().splitlines()) == 5
    with pytest.raises(DataError, match="5 of 61 rows were rejected"):  # a rerun reusing the shards fails too
        prepare(config(tmp_path, mixed, "data.max_reject_fraction=0.05"), log=lambda s: None)


def test_streaming_dataset_without_materialising(tmp_path, mixed):
    cfg = config(tmp_path, mixed)
    ds = build_dataset(cfg, tmp_path / "side")
    packs = list(ds.iter_rows())
    assert sum(len(p["seq_lens"]) for p in packs) == 66
    assert not (tmp_path / "out").exists()


def test_cli_prepares_the_shared_samples_with_smollm2(tmp_path, root, session_address):
    """English, Chinese and identity samples end to end through `raylora prepare`: a Ray driver of its own, on the
    module's cluster (``RAY_ADDRESS``; a cluster of its own costs about 10 s of CPU)."""
    if not SHARED.exists():
        pytest.skip("../shared/data is not beside this checkout")
    proc = subprocess.run(
        [sys.executable, "jobs/prepare.py", "configs/smollm2_prepare_cpu.yaml", f"data.output_dir={tmp_path}/out"],
        cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": session_address},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows_read"] == 999 + 1000 + 91
    assert summary["rows_rejected"] == 0 and summary["examples"] == 999 + 1000 + 182
    assert summary["packing_efficiency"] >= 0.95
    assert "packing efficiency" in proc.stdout and "rows/s" in proc.stdout
    eval_rows = shards(tmp_path / "out", "eval")
    assert eval_rows and all(max(r["position_ids"]) < 1024 for r in eval_rows)


def test_prepare_reads_the_registry_samples_and_rejects_bad_tool_rows_by_file_and_line(tmp_path, root):
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    call = {"from": "function_call", "value": "{'name': 'w'}"}
    (tmp_path / "tools.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                good,
                {**good, "tools": '{"name": "w"}'},
                {"conversations": [good["conversations"][0], call, *good["conversations"][1:]]},
            )
        )
        + "\n"
    )
    user = {"role": "user", "content": "q"}
    (tmp_path / "parts.jsonl").write_text(
        json.dumps({"messages": [user, {"role": "assistant", "content": "a"}]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "value": "x.png"}]},
                                   {"role": "assistant", "content": "a"}]}) + "\n"
        + json.dumps({"messages": [user, {"role": "assistant", "content": "a", "loss_weight": 2}]}) + "\n"
    )  # fmt: skip
    names = ", ".join(
        f"{{name: {n}}}"
        for n in ("glaive_toolcall_demo", "openai_tools_demo", "v1_parts_demo", "reasoning_demo", "mask_history_demo")
    )
    cfg = load_config(
        None,
        [
            f"data.dataset_info={root / 'data' / 'dataset_info.json'}",
            f"data.sources=[{names}, {{path: {tmp_path}/tools.jsonl}}, {{path: {tmp_path}/parts.jsonl}}]",
            f"data.output_dir={tmp_path}/out", "model.name_or_path=tiny-llama", "data.max_reject_fraction=0.5",
            "data.cutoff_len=4096",  # the tiny tokenizer spends a token per byte
        ],
    )  # fmt: skip
    summary = prepare(cfg, log=lambda s: None)
    assert (summary["rows_read"], summary["rows_rejected"]) == (4 + 2 + 3 + 3 + 2 + 3 + 3, 4)
    rejects = {
        (Path(r["source"]).name, r["line"]): r["reason"]
        for r in map(json.loads, (tmp_path / "out" / "rejects.jsonl").read_text().splitlines())
    }
    assert rejects == {
        ("tools.jsonl", 2): "field 'tools' is a dict, expected a list of function schemas",
        ("tools.jsonl", 3): "the function_call turn 1 is not valid JSON (Expecting property name enclosed in double "
        "quotes): \"{'name': 'w'}\"",
        ("parts.jsonl", 2): "turn 0: content part type 'image_url' is not supported; parts must be text, reasoning or "
        "tool_call",
        ("parts.jsonl", 3): "turn 1: loss_weight must be a number in [0, 1], got 2",
    }
    tok = tiny_tokenizer()
    texts = [tok.decode(p["input_ids"]) for p in shards(tmp_path / "out", "train")]
    assert sum(t.count("# Tools\n") for t in texts) == 4 + 2 + 1 + 1  # every row with tools shows their schemas
    calls = 4 + 2 + 1 + 1  # glaive, openai, v1, reasoning; each tools block adds one in its format hint
    assert sum(t.count('<tool_call>\n{"name"') for t in texts) == calls + 8


def test_prepare_writes_each_pair_as_two_sequences_of_one_pack(tmp_path):
    """Under a preference objective a pair is prompt + chosen answer, then prompt + rejected answer, in one pack; the
    eval split holds whole pairs; a bad pair is a reject like any row."""
    rows = [
        {"conversations": [{"from": "human", "value": f"Question {i}?"}],
         "chosen": {"from": "gpt", "value": f"Answer {i}, from {{{{name}}}}."},
         "rejected": {"from": "gpt", "value": f"No answer {i}."}}
        for i in range(40)
    ]  # fmt: skip
    rows[6]["rejected"] = rows[6]["chosen"]
    rows[9] = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "kto_tag": True}
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [f"data.sources=[{{path: {tmp_path}/pairs.jsonl}}]", "data.placeholders.name=Ray", "data.cutoff_len=256",
         "data.eval_fraction=0.2", f"data.output_dir={tmp_path}/out", "model.name_or_path=tiny-llama",
         "train.objective=dpo", "data.max_reject_fraction=0.1"],
    )  # fmt: skip
    summary = prepare(cfg, log=lambda s: None)
    assert (summary["rows_read"], summary["rows_rejected"], summary["rows_kept"]) == (40, 2, 38)
    assert (summary["pairs"], summary["examples"]) == (38, 76)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert {r["line"]: r["reason"].split(" (")[0] for r in rejects} == {
        7: "the chosen and rejected answers are identical",
        10: "an unpaired preference row",
    }
    tok = tiny_tokenizer()
    seen = {}
    for split in ("train", "eval"):
        packs = shards(tmp_path / "out", split)
        assert sum(len(p["seq_lens"]) for p in packs) == 2 * summary["splits"][split]["pairs"]
        for pack in packs:
            assert len(pack["seq_lens"]) % 2 == 0 and sum(pack["seq_lens"]) == pack["num_tokens"] <= 256
            start = 0
            for n, shared in zip(pack["seq_lens"], pack["shared"], strict=True):
                assert pack["position_ids"][start : start + n] == list(range(shared, shared + n))
                start += n
            ends = np.cumsum([0, *pack["seq_lens"]])
            for a, b, c in zip(ends[0:-1:2], ends[1::2], ends[2::2], strict=True):
                chosen, rejected = tok.decode(pack["input_ids"][a:b]), tok.decode(pack["input_ids"][b:c])
                i = int(chosen.split("Question ")[1].split("?")[0])
                prompt = f"<|im_start|>user\nQuestion {i}?<|im_end|>\n<|im_start|>assistant\n"
                assert chosen == prompt + f"Answer {i}, from Ray.<|im_end|>\n"
                # the prompt once: the rejected answer follows its last token and reads the rest from the chosen
                shared = pack["shared"][list(ends).index(b)]
                assert (
                    tok.decode(pack["input_ids"][a : a + shared]) + rejected == prompt + f"No answer {i}.<|im_end|>\n"
                )
                learned = [t for t, lab in zip(pack["input_ids"][b:c], pack["labels"][b:c], strict=True) if lab >= 0]
                assert tok.decode(learned) == f"No answer {i}.<|im_end|>\n"
                seen[i] = split
    assert sorted(seen) == sorted(set(range(40)) - {6, 9})
    assert 0 < list(seen.values()).count("eval") == summary["splits"]["eval"]["pairs"] < 19
