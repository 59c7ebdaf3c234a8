import dataclasses

import pytest
import yaml

from raylora.config import (
    ConfigError,
    JobConfig,
    LoraArgs,
    SourceArgs,
    from_dict,
    load_config,
    reference_markdown,
    to_dict,
    to_record,
)


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_round_trip_through_dict_and_yaml():
    cfg = JobConfig()
    assert from_dict(to_dict(cfg)) == cfg
    assert from_dict(yaml.safe_load(yaml.safe_dump(to_dict(cfg)))) == cfg


def test_full_file_round_trips(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            """
data: {sources: [{path: a.jsonl}, {path: b.json, format: alpaca}], cutoff_len: 64, placeholders: {name: Bob}}
lora: {rank: 4, target_modules: [q_proj, v_proj], use_dora: true}
train: {lr: 1e-4, max_steps: 3}
backend: {hccl: {buffsize: 400}}
""",
        )
    )
    assert cfg.data.sources == [SourceArgs("a.jsonl"), SourceArgs("b.json", "alpaca")]
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.lora == LoraArgs(rank=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    assert cfg.backend.hccl.buffsize == 400
    assert from_dict(to_dict(cfg)) == cfg


def test_overrides_are_coerced_to_field_types(tmp_path):
    cfg = load_config(
        write(tmp_path, "train: {lr: 0.1}\n"),
        ["train.lr=3e-4", "train.max_steps=7", "tracking.enabled=false", "lora.target_modules=[q_proj,v_proj]",
         "model.cache_dir=null", "lora.alpha=8", "data.placeholders.name=Ann"],
    )  # fmt: skip
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.max_steps == 7
    assert cfg.tracking.enabled is False
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.cache_dir is None
    assert cfg.lora.alpha == 8.0 and isinstance(cfg.lora.alpha, float)
    assert cfg.data.placeholders == {"name": "Ann"}


def test_single_string_becomes_a_list():
    cfg = load_config(None, ["lora.target_modules=all-linear"])
    assert cfg.lora.target_modules == ["all-linear"]


def test_typo_wrong_type_and_range_are_reported_together(tmp_path):
    path = write(tmp_path, "lora:\n  rnak: 8\n  dropout: 1.5\ntrain:\n  max_steps: ten\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    problems = dict(err.value.problems)
    assert set(problems) == {"lora.rnak", "lora.dropout", "train.max_steps"}
    assert "did you mean 'rank'" in problems["lora.rnak"]
    assert "'ten' (str)" in problems["train.max_steps"] and "expected int" in problems["train.max_steps"]
    assert "1.5" in problems["lora.dropout"] and "≥ 0.0 and < 1.0" in problems["lora.dropout"]
    message = str(err.value)
    assert message.startswith(f"{path} has 3 problems:")
    assert all(key in message for key in problems)


def test_unknown_section_and_choice_suggest_nearest(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "trian: {lr: 1}\nbackend: {device: npux}\n"))
    problems = dict(err.value.problems)
    assert "did you mean 'train'" in problems["trian"]
    assert "allowed: auto, npu, cuda, cpu; did you mean 'npu'?" in problems["backend.device"]


def test_bad_overrides_join_the_file_problems(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            write(tmp_path, "lora: {rank: 0}\n"), ["train.lr", "train.lrr=1", "backend.hccl.connect_timeout=60"]
        )
    paths = [p for p, _ in err.value.problems]
    assert paths == ["train.lr", "lora.rank", "train.lrr", "backend.hccl.connect_timeout"]
    assert "did you mean 'lr'" in dict(err.value.problems)["train.lrr"]
    assert "≥ 120 and ≤ 7200" in dict(err.value.problems)["backend.hccl.connect_timeout"]


def test_exec_timeout_is_held_to_cann_s_widest_range(tmp_path):
    """Issue #40: HCCL_EXEC_TIMEOUT had no upper bound (Atlas A2/A3 take 0-2147483647; the SoC's own range is checked
    where the worker sees it)."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "train: {lr: 1.0e-4}\n"), ["backend.hccl.exec_timeout=2147483648"])
    assert "≥ 0 and ≤ 2147483647" in dict(err.value.problems)["backend.hccl.exec_timeout"]
    cfg = load_config(write(tmp_path, "train: {lr: 1.0e-4}\n"), ["backend.hccl.exec_timeout=0"])
    assert cfg.backend.hccl.exec_timeout == 0


def test_list_items_and_nested_sections_are_checked(tmp_path):
    text = "data:\n  sources:\n    - {path: a.json, fromat: alpaca}\n    - {format: alpaca}\nlora: {target_modules: [q_proj, 3]}\n"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    problems = dict(err.value.problems)
    assert "did you mean 'format'" in problems["data.sources[0].fromat"]
    assert "is required" in problems["data.sources[1].path"]
    assert "expected str" in problems["lora.target_modules[1]"]


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="data.eval_count"):
        load_config(None, ["data.eval_fraction=0.1", "data.eval_count=3"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1,\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- 1\n"))


def test_every_field_is_documented_in_the_reference():
    table = reference_markdown()

    def keys(value, prefix):
        for f in dataclasses.fields(value):
            inner = getattr(value, f.name)
            yield from keys(inner, f"{prefix}{f.name}.") if dataclasses.is_dataclass(inner) else [f"{prefix}{f.name}"]

    for key in keys(JobConfig(), ""):
        assert f"`{key}`" in table


def test_names_from_hugging_face_and_llama_factory_point_at_ours(tmp_path):
    text = (
        "train: {learning_rate: 1e-4, gradient_accumulation_steps: 4, per_device_train_batch_size: 2, lr_rate: 1,\n"
        "        lr_warmup_steps: 2, lr_scheduler: cosine}\n"
        "lora: {lora_rank: 8, lora_alpha: 16}\nmodel: {model_name_or_path: x}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    suggested = {path: message.split("'")[1] for path, message in err.value.problems}
    assert suggested == {
        "train.learning_rate": "lr", "train.lr_rate": "lr", "train.gradient_accumulation_steps": "grad_accum",
        "train.per_device_train_batch_size": "batch_size", "lora.lora_rank": "rank", "lora.lora_alpha": "alpha",
        "model.model_name_or_path": "name_or_path", "train.lr_warmup_steps": "warmup_steps",
        "train.lr_scheduler": "scheduler",
    }  # fmt: skip


def test_warm_up_as_long_as_the_run_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_steps=10", "train.warmup_steps=10"])
    ((key, message),) = err.value.problems
    assert key == "train.warmup_steps" and message.startswith("10 is not below train.max_steps=10: warm-up would")
    assert load_config(None, ["train.max_steps=10", "train.warmup_steps=9"]).train.warmup_steps == 9


def test_records_of_a_job_hold_no_keys():
    """Found by use: serve.api_key and serve.admin_key reached MLflow's params and every run's config.yaml."""
    cfg = load_config(None, ["serve.api_key=TOPSECRET", "serve.admin_key=ADMINSECRET"])
    record = to_record(cfg)
    assert record["serve"]["api_key"] == record["serve"]["admin_key"] == "<redacted>"
    assert "SECRET" not in repr(record) and cfg.serve.api_key == "TOPSECRET"  # the job itself keeps them
    assert to_record(load_config(None))["serve"]["api_key"] is None
    with pytest.raises(ConfigError, match="what a written config holds in place of the key"):  # review
        from_dict(record)


def test_a_broken_list_override_and_other_names_of_values_are_caught():
    """Found by use: lora.target_modules=[q_proj became the module name '[q_proj'; device gpu suggested 'npu'."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["lora.target_modules=[q_proj", "backend.device=gpu", "backend.precision=bfloat16"])
    problems = dict(err.value.problems)
    assert "is not valid YAML" in problems["lora.target_modules"]
    assert "did you mean 'cuda'" in problems["backend.device"]
    assert "did you mean 'bf16'" in problems["backend.precision"]


def test_overrides_index_into_lists(tmp_path):
    """Found by use: `data.sources.0.path=...` turned the list of sources into a mapping {'0': ...}."""
    path = write(
        tmp_path,
        "data:\n  sources:\n    - {path: a.json}\n    - {path: b.json, weight: 2}\n"
        "lora: {target_modules: [q_proj, v_proj]}\n",
    )
    cfg = load_config(path, ["data.sources.1.path=c.jsonl", "data.sources.0.weight=3", "lora.target_modules.1=o_proj"])
    assert [(s.path, s.weight) for s in cfg.data.sources] == [("a.json", 3), ("c.jsonl", 2)]
    assert cfg.lora.target_modules[1] == "o_proj"
    with pytest.raises(ConfigError) as err:
        load_config(path, ["data.sources.2.path=x", "data.sources.first.path=y", "lora.target_modules.-1=q"])
    assert dict(err.value.problems) == {
        "data.sources.2.path": "data.sources is a list with indexes 0-1; '2' is not one of them",
        "data.sources.first.path": "data.sources is a list with indexes 0-1; 'first' is not one of them",
        "lora.target_modules.-1": "lora.target_modules is a list with indexes 0-1; '-1' is not one of them",
    }


def test_the_old_hccl_keys_are_refused_naming_their_new_place(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "backend: {hccl_connect_timeout: 600}\n"), ["backend.hccl_socket_ifname=enp"])
    problems = dict(err.value.problems)
    assert problems["backend.hccl_connect_timeout"] == "renamed: write backend.hccl.connect_timeout instead"
    assert problems["backend.hccl_socket_ifname"] == "renamed: write backend.hccl.socket_ifname instead"
