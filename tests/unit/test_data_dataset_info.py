"""LLaMA-Factory's dataset_info.json as data.sources[].name."""

import json
import shutil
from pathlib import Path

import pytest

from raylora.config import ConfigError, load_config
from raylora.data.dataset_info import RegistryError, load_registry, resolve
from raylora.data.pipeline import DataError, plan_sources

DATA = Path(__file__).resolve().parents[2] / "data"


def registry(tmp_path, entries):
    path = tmp_path / "dataset_info.json"
    path.write_text(json.dumps(entries))
    return str(path)


def data_config(*overrides):
    return load_config(None, list(overrides)).data


def test_the_shipped_registry_names_every_sample():
    data = data_config(
        f"data.dataset_info={DATA / 'dataset_info.json'}",
        "data.sources=[{name: glaive_toolcall_demo}, {name: openai_tools_demo, weight: 2}, {name: v1_parts_demo}, "
        "{name: reasoning_demo}, {name: mask_history_demo}, {name: raylora_identity}]",
    )
    plan = {Path(p).name: how for p, how in plan_sources(data).items()}
    assert plan == {
        "glaive_toolcall_demo.json": {
            "format": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}, "weight": 1.0},
        "openai_tools_demo.jsonl": {
            "format": "openai", "weight": 2.0,
            "columns": {"messages": "messages", "tools": "tools", "role_tag": "role", "content_tag": "content"}},
        "v1_parts_demo.jsonl": {"format": "openai", "columns": {}, "weight": 1.0},
        "reasoning_demo.jsonl": {"format": "openai", "columns": {}, "weight": 1.0},
        "mask_history_demo.jsonl": {"format": "sharegpt", "columns": {}, "weight": 1.0},
        "raylora_identity.jsonl": {
            "format": "alpaca", "columns": {"instruction": "instruction", "input": "input", "output": "output"},
            "weight": 1.0},
    }  # fmt: skip


def test_llamafactory_names_translate_and_file_name_is_beside_the_registry(tmp_path):
    entries = {
        "qa": {"file_name": "qa.json", "columns": {"prompt": "q", "query": "ctx", "response": "a", "history": "h"}},
        "c4": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}},
        "chat": {"file_name": "chat", "formatting": "sharegpt", "tags": {"role_tag": "role", "user_tag": "user"}},
        "oa": {"file_name": "oa.jsonl", "formatting": "openai",
               "tags": {"role_tag": "speaker", "user_tag": "human", "assistant_tag": "bot"}},
    }  # fmt: skip
    path = registry(tmp_path, entries)
    reg = load_registry(path)
    assert resolve(reg, path, "qa") == {
        "path": str(tmp_path / "qa.json"),
        "format": "alpaca",
        "columns": {"instruction": "q", "input": "ctx", "output": "a", "history": "h"},
    }
    assert resolve(reg, path, "c4")["format"] == "text" and resolve(reg, path, "c4")["columns"] == {"text": "text"}
    assert resolve(reg, path, "chat")["columns"] == {"role_tag": "role", "user_tag": "user"}
    assert resolve(reg, path, "oa") == {
        "path": str(tmp_path / "oa.jsonl"),
        "format": "sharegpt",
        "columns": {
            "messages": "messages", "role_tag": "speaker", "content_tag": "content", "user_tag": "human",
            "assistant_tag": "bot", "system_tag": "system", "observation_tag": "tool",
        },
    }  # fmt: skip


@pytest.mark.parametrize(
    "entry,reason",
    [
        ({"hf_hub_url": "llamafactory/glaive_toolcall_en"}, "hf_hub_url \\(a Hugging Face hub dataset: raylora reads local"),
        ({"file_name": "a.json", "num_samples": 10}, "num_samples \\(sampling by count"),
        ({"file_name": "a.json", "columns": {"prompt": "q", "chosen": "c", "rejected": "r"}}, "has chosen, rejected columns but not ranking: true"),
        ({"file_name": "a.json", "formatting": "sharegpt", "columns": {"messages": "m", "images": "i"}}, "has images columns"),
        ({"file_name": "a.json", "formating": "sharegpt"}, "formating \\(not a LLaMA-Factory key raylora knows"),
        ({"formatting": "sharegpt"}, "has no file_name"),
        ({"file_name": "a.json", "formatting": "parquet"}, "formatting 'parquet' is not alpaca, sharegpt or openai"),
        ({"file_name": "a.json", "columns": {"output": "o"}}, "alpaca columns are prompt, query, response"),
        ({"file_name": "a.json", "formatting": "sharegpt", "tags": {"speaker_tag": "s"}}, "speaker_tag unknown"),
    ],
)  # fmt: skip
def test_entries_raylora_cannot_honour_are_refused_with_the_reason(tmp_path, entry, reason):
    path = registry(tmp_path, {"d": entry})
    with pytest.raises(RegistryError, match=reason):
        resolve(load_registry(path), path, "d")


def test_an_unknown_name_suggests_the_nearest_before_anything_runs(tmp_path):
    shutil.copy(DATA / "glaive_toolcall_demo.json", tmp_path)
    path = registry(tmp_path, {"glaive_toolcall_en_demo": {"file_name": "glaive_toolcall_demo.json",
                                                           "formatting": "sharegpt"}, "alpaca_en_demo": {}})  # fmt: skip
    data = data_config(f"data.dataset_info={path}", "data.sources=[{name: glaive_toolcall_demo}, {name: alpaca_demo}]")
    with pytest.raises(DataError) as err:
        plan_sources(data)
    assert (
        f"data.sources[0].name: dataset 'glaive_toolcall_demo' is not in {path}; nearest: glaive_toolcall_en_demo"
        in str(err.value)
    )
    assert "data.sources[1].name: dataset 'alpaca_demo' is not in" in str(err.value)
    assert "nearest: alpaca_en_demo" in str(err.value)


def test_a_missing_or_broken_registry_is_reported_once(tmp_path):
    data = data_config(f"data.dataset_info={tmp_path}/nope.json", "data.sources=[{name: a}, {name: b}]")
    with pytest.raises(DataError) as err:
        plan_sources(data)
    assert str(err.value).count("nope.json does not exist") == 1
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DataError, match="bad.json is not valid JSON"):
        plan_sources(data_config(f"data.dataset_info={tmp_path}/bad.json", "data.sources=[{name: a}]"))


def test_a_source_columns_override_the_registry_and_are_checked(tmp_path):
    shutil.copy(DATA / "glaive_toolcall_demo.json", tmp_path)
    path = registry(tmp_path, {"g": {"file_name": "glaive_toolcall_demo.json", "formatting": "sharegpt"}})
    plan = plan_sources(data_config(f"data.dataset_info={path}", "data.sources=[{name: g, columns: {tools: tools}}]"))
    assert list(plan.values())[0]["columns"] == {"tools": "tools"}
    with pytest.raises(DataError, match="unknown field funcs"):
        plan_sources(data_config(f"data.dataset_info={path}", "data.sources=[{name: g, columns: {funcs: f}}]"))


def test_config_needs_a_path_or_a_name_and_a_registry_for_a_name():
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            ["data.sources=[{name: a}, {path: x.json, name: b}, {format: alpaca}, {path: ''}]", "train.lr=-1"],
        )
    problems = dict(err.value.problems)
    assert "data.dataset_info (the registry file) is not set" in problems["data.sources[0].name"]
    assert "give path or name, not both" in problems["data.sources[1]"]
    assert "is required" in problems["data.sources[2].path"]
    assert "must not be empty" in problems["data.sources[3].path"]
    assert "train.lr" in problems  # reported together with the type errors
