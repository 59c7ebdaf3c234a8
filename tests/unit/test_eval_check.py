"""raylora eval before Ray starts: candidates found and checked, the eval set read with its rejects, every problem
listed together."""

import json
from pathlib import Path

import mlflow
import pytest
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from raylora.config import ConfigError, LoraArgs, load_config
from raylora.eval.candidates import resolve
from raylora.eval.run import check_eval
from raylora.model_files import tiny_tokenizer
from raylora.models import lora_config, model_skeleton, tiny_model
from raylora.registry import register
from raylora.tracking import finish_run, start_run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_eval_cpu.yaml"


def save_adapter(folder: Path, hidden: int | None = None) -> Path:
    base = tiny_model("llama")
    if hidden is not None:  # another base: its layers have other shapes
        config = base.config
        config.hidden_size, config.intermediate_size = hidden, 2 * hidden
        base = AutoModelForCausalLM.from_config(config)
    get_peft_model(base, lora_config(base, LoraArgs(rank=4))).save_pretrained(folder)
    return folder


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_every_problem_is_listed_together_before_ray(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = start_run(load_config(CONFIG, [f"tracking.uri={uri}", "tracking.enabled=true"]).tracking, "t", {})
    client = mlflow.MlflowClient(uri)
    client.log_artifacts(run, str(save_adapter(tmp_path / "logged")), artifact_path="adapter")
    finish_run(load_config(CONFIG, [f"tracking.uri={uri}"]).tracking, run, [], "FINISHED")
    register(uri, "tiny-best", f"runs:/{run}/adapter")
    other = save_adapter(tmp_path / "other-base", hidden=32)
    no_refs = write_rows(tmp_path / "texts.jsonl", [{"text": "plain text, no answer"}, {"text": "more"}])
    cfg = load_config(CONFIG, [
        "tracking.enabled=true", f"tracking.uri={uri}", f"eval.output_dir={tmp_path}/out",
        f"eval.candidates=[base, {other}, {tmp_path}/missing, models:/tiny-best/7]",
        f"eval.sources=[{{path: {no_refs}}}]", "eval.metrics=[exact_match, rouge]",
    ])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_eval(cfg, "eval.yaml")
    said = dict(e.value.problems)
    assert set(said) == {
        "eval.metrics",
        "eval.candidates[1]",
        "eval.candidates[2]",
        "eval.candidates[3]",
        "eval.sources",
    }
    assert "'rouge'" in said["eval.metrics"] and "rouge-l" in said["eval.metrics"]
    assert "does not fit" in said["eval.candidates[1]"] and "trained on base model" in said["eval.candidates[1]"]
    assert "no such folder" in said["eval.candidates[2]"]
    assert "no version 7" in said["eval.candidates[3]"] and "versions: 1" in said["eval.candidates[3]"]
    assert "no row with a reference" in said["eval.sources"] and "no assistant turn" in said["eval.sources"]


def test_candidates_expand_a_sweep_name_runs_and_download_a_registered_version(tmp_path):
    sweep = tmp_path / "sweep"
    for trial in ("a1", "b2"):
        save_adapter(sweep / "trials" / trial / "adapter")
        (sweep / "trials" / trial / "mlflow_run.json").write_text(json.dumps({"run_id": f"run-{trial}"}))
    (sweep / "trials" / "c3").mkdir()  # stopped early: no adapter
    run = save_adapter(tmp_path / "job" / "adapter")
    (tmp_path / "job" / "mlflow_run.json").write_text(json.dumps({"run_id": "run-job"}))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracking = load_config(CONFIG, [f"tracking.uri={uri}", "tracking.enabled=true"]).tracking
    logged = start_run(tracking, "t", {})
    mlflow.MlflowClient(uri).log_artifacts(logged, str(save_adapter(tmp_path / "logged")), artifact_path="adapter")
    register(uri, "tiny-best", f"runs:/{logged}/adapter")
    cfg = load_config(CONFIG, [
        "tracking.enabled=true", f"tracking.uri={uri}", f"eval.output_dir={tmp_path}/out",
        f"eval.candidates=[base, {sweep}, {run}, {run}, models:/tiny-best/latest]",
    ])  # fmt: skip
    found, problems = resolve(cfg, model_skeleton(cfg.model))
    assert problems == []
    assert [(c.name, c.run_id) for c in found] == [
        ("base", None), ("trial-a1", "run-a1"), ("trial-b2", "run-b2"), ("job", "run-job"), ("tiny-best-v1", logged)
    ]  # fmt: skip
    assert (Path(found[-1].path) / "adapter_config.json").is_file()
    assert Path(found[-1].path) == tmp_path / "out" / "adapters" / "tiny-best-v1"


def test_the_eval_set_rejects_rows_with_their_reasons_and_keeps_tool_call_references(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    rows = write_rows(tmp_path / "set.jsonl", [
        {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Raylora Assistant."}]},
        "{not json",
        {"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "long"}]},
        {"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]}],
         "tools": tools},
    ])  # fmt: skip
    cfg = load_config(CONFIG, [f"eval.sources=[{{path: {rows}}}]", "eval.max_rows=null", "eval.max_tokens=16"])
    candidates, got, rejects = check_eval(cfg)
    assert [c.name for c in candidates] == ["base"]
    assert [r["line"] for r in rejects] == [2, 3] and "Expecting property name" in rejects[0]["reason"]
    assert rejects[1]["reason"].startswith("the prompt has ") and "context of 2048 tokens" in rejects[1]["reason"]
    assert [r.line for r in got] == [1, 4] and got[0].keys == ["Raylora Assistant"]
    assert got[1].calls[0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert got[1].reference.startswith("<tool_call>") and got[1].tools == tools
    tokenizer = tiny_tokenizer()
    assert tokenizer.decode(got[0].answer_ids).startswith("I am Raylora Assistant.")
    assert tokenizer.decode(got[0].prompt_ids).endswith("assistant\n")
