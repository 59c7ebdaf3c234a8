"""The demo's pieces that need no cluster: its checks, the held-out questions, scoring and the report."""

import json
import socket
from pathlib import Path

import pyarrow as pa
import pytest

from raylora.config import ConfigError, load_config
from raylora.data.encode import tokenizer_spec
from raylora.data.read import iter_blocks
from raylora.data.sources import held_out_conversations, plan_sources
from raylora.data.transforms import encode_batch, worker_spec
from raylora.demo import absolute_sources, check_demo, identity_answers, render_report
from raylora.models import load_model

ROOT = Path(__file__).resolve().parents[2]
TINY_DEMO = ROOT / "configs" / "tiny_demo_cpu.yaml"


def test_the_jobs_inputs_are_made_absolute_and_registry_names_stay(tmp_path, monkeypatch):
    """The demo's jobs read relative inputs Ray's copy of the working folder lacks from the demo's output folder, so
    every input found here is made absolute first: data files, a local model, a model cache (review finding: a
    relative model folder was looked for under the output folder)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    (tmp_path / "rows.jsonl").write_text("{}\n")
    cfg = load_config(
        TINY_DEMO, ["model.name_or_path=models/mine", "model.cache_dir=models", "data.sources=[{path: rows.jsonl}]"]
    )
    made = absolute_sources(cfg)
    assert made.model.name_or_path == str(tmp_path / "models" / "mine") and made.model.cache_dir == str(
        tmp_path / "models"
    )
    assert made.data.sources[0].path == str(tmp_path / "rows.jsonl")
    assert absolute_sources(load_config(TINY_DEMO)).model.name_or_path == "tiny-llama"


def test_check_demo_lists_every_problem_before_anything_runs():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = load_config(
            TINY_DEMO,
            ["tracking.enabled=false", "data.eval_fraction=0", "data.placeholders={}", "tune.space={}",
             f"serve.port={port}"],
        )  # fmt: skip
        with pytest.raises(ConfigError) as e:
            check_demo(cfg, "demo.yaml")
    keys = [k for k, _ in e.value.problems]
    assert {"tracking.enabled", "data.eval_fraction", "data.placeholders.name", "tune.space", "serve.port"} <= set(keys)
    assert "serve.port=PORT" in str(e.value) and str(port) in str(e.value)


@pytest.mark.parametrize(
    "split",
    [["data.eval_fraction=0.25"], ["data.eval_fraction=0", "data.eval_count=5"],
     # a source weighted below 1: only the held-out rows its weight keeps are in the eval split (raylora eval's set)
     ["data.eval_fraction=0.5", "data.sources=[{path: data/raylora_identity.jsonl, weight: 0.5}]"]],
)  # fmt: skip
def test_held_out_rows_are_the_rows_the_pipeline_puts_in_the_eval_split(split, tmp_path):
    cfg = load_config(TINY_DEMO, split)
    plan = plan_sources(cfg.data)
    _, tokenizer = load_model(cfg.model)
    spec = worker_spec(cfg.data, tokenizer_spec(tokenizer, cfg.data.template))
    (tmp_path / "rejects").mkdir()
    (tmp_path / "counts").mkdir()
    eval_keys = None
    if cfg.data.eval_count:  # the pipeline ranks every row by the same seeded hash (its _eval_keys, without Ray)
        from raylora.data.transforms import split_draw

        keys = []
        for path in plan:
            with open(path, "rb") as f:
                keys += [
                    (path, line) for block in iter_blocks(f, path, None) for line in block.column("line").to_pylist()
                ]
        keys.sort(key=lambda k: split_draw(cfg.data.seed, *k))
        eval_keys = frozenset(keys[: cfg.data.eval_count])
    encoded = []
    for path in plan:
        with open(path, "rb") as f:
            encoded += [encode_batch(b, spec, plan, str(tmp_path), eval_keys) for b in iter_blocks(f, path, None)]
    table = pa.concat_tables(encoded)
    in_eval = table.column("split").to_pylist().count("eval")
    held = held_out_conversations(cfg.data)
    assert 0 < len(held) == in_eval
    assert all(c.messages[-1]["role"] == "assistant" for c in held)


@pytest.mark.parametrize("split", [["data.eval_fraction=0.25"], ["data.eval_fraction=0", "data.eval_count=5"]])
def test_the_held_out_rows_do_not_depend_on_where_the_data_lies(split, tmp_path):
    source = ROOT / "data" / "raylora_identity.jsonl"
    held = []
    for folder in ("clone-a", "elsewhere/clone-b"):
        (tmp_path / folder).mkdir(parents=True)
        copy = tmp_path / folder / source.name
        copy.write_bytes(source.read_bytes())
        cfg = load_config(TINY_DEMO, [*split, f"data.sources=[{{path: {copy}}}]"])
        held.append(held_out_conversations(cfg.data))
    assert held[0] and held[0] == held[1]


def test_identity_answers_pair_the_base_and_the_best_trial_on_rows_with_keys(tmp_path):
    rows = [
        {"row": 0, "candidate": "base", "keys": ["R"], "question": "Who?", "reference": "I am R.", "answer": " A cat. "},
        {"row": 0, "candidate": "trial-b", "keys": ["R"], "question": "Who?", "reference": "I am R.", "answer": "I am R."},
        {"row": 0, "candidate": "trial-c", "keys": ["R"], "question": "Who?", "reference": "I am R.", "answer": "R?"},
        {"row": 1, "candidate": "base", "keys": [], "question": "2+2?", "reference": "4", "answer": "4"},
    ]  # fmt: skip
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert identity_answers(tmp_path / "answers.jsonl", "trial-b") == [
        {"question": "Who?", "reference": "I am R.", "before": "A cat.", "after": "I am R."}
    ]
    with pytest.raises(RuntimeError, match="no identity question"):
        identity_answers(_only(tmp_path, rows[3]), "trial-b")


def _only(tmp_path, row) -> Path:
    path = tmp_path / "general.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def test_report_table_holds_both_sides_every_trial_and_where_to_look():
    cfg = load_config(TINY_DEMO)
    scores = {
        "base": {"metrics": {"exact_match": 0.0, "contains": 0.0, "rouge-l": 3.5, "bleu-4": 1.25, "reference_loss": 2.5}},
        "trial-t1": {"metrics": {"exact_match": 1.0, "contains": 1.0, "rouge-l": 100.0, "bleu-4": 100.0,
                                 "reference_loss": 0.5}},
        "trial-t2": {"metrics": {"exact_match": 0.0, "contains": 0.5, "rouge-l": 50.0, "bleu-4": 20.0}},
    }  # fmt: skip
    report = {
        "questions": [{"question": "Who are you?", "reference": "I am R.", "before": "A cat.", "after": "I am R."}],
        "eval": {"candidates": scores, "rows": 3, "rejected": 0, "tokens_per_s": 40.0},
        "served": {"answers": ["I am R."], "tokens_per_s": 30.0, "same_as_eval": 1},
        "train_job": {"eval_loss": 0.7},
        "best": {"trial": "t1", "metric": 0.5, "lora.rank": "8", "train.lr": "0.01"},
        "stages": {"prepare": 1.0, "train": 2.0},
        "urls": {"mlflow": "mlflow ui ...", "mlflow_url": "http://127.0.0.1:5000", "dashboard": "http://d",
                 "curl": "curl ...", "openai": "python ..."},
    }  # fmt: skip
    text = render_report(report, cfg)
    assert "| before: base model | after: best trial of the sweep (lora.rank=8, train.lr=0.01) | trial-t2 |" in text
    assert "| exact match (every held-out question) | 0% | 100% | 0% |" in text
    assert "| identity answers naming whom the reference names | 0% | 100% | 50% |" in text
    assert "| loss of the reference answers | 2.50 | 0.50 | n/a |" in text
    assert "ended at eval loss 0.7000" in text and "1/1 identity answers equal to the eval's" in text
    assert "- before: A cat." in text and "- after: I am R." in text and "- served: I am R." in text
    assert "total 3 s" in text and "http://127.0.0.1:5000" in text
    json.dumps(report)


def test_the_demos_cluster_takes_its_dashboard_port_under_the_host_lock(tmp_path, monkeypatch):
    """Found by a fresh-clone suite: the demo looked at 8265, another cluster starting on the host (the other pytest
    process) bound it, and `ray start` came up without a dashboard, so `ray job submit` could not connect. The demo
    now picks the port as `ensure_ray` does, under the same host lock, held until `ray start` returns."""
    import threading

    from raylora import cluster, demo

    started = []
    monkeypatch.setattr(demo, "run_logged", lambda cmd, *a: started.append(cmd) or "")
    with socket.socket() as holder:
        with cluster.dashboard_port() as taken:
            holder.bind(("127.0.0.1", taken))  # the other cluster's dashboard, bound before its lock is released
            holder.listen()
            starter = threading.Thread(target=demo.start_cluster, args=(str(tmp_path), {}, tmp_path / "log", print))
            starter.start()
            starter.join(timeout=1)
            assert starter.is_alive() and not started  # waiting for the lock, no port chosen yet
        starter.join(timeout=10)
    (cmd,) = started
    chosen = int(next(a for a in cmd if a.startswith("--dashboard-port=")).split("=")[1])
    assert chosen != taken and 8265 <= chosen < 8315


def test_the_demos_cluster_processes_are_told_their_own_dashboard_and_the_demo_keeps_its_environment(
    tmp_path, monkeypatch
):
    """Found by a fresh-clone `make demo` beside another Ray instance: the train job's placement-group cleaner failed
    with "Found multiple active Ray instances" (Ray's state API looks for "the" cluster of the host). The processes
    `ray start` starts take its environment: it names their dashboard, as `ensure_ray` does for the clusters it starts;
    the demo's own environment, which later `ray job submit`s use, does not get it."""
    from raylora import demo

    envs = []
    monkeypatch.setattr(demo, "run_logged", lambda cmd, log_path, env, log: envs.append((cmd, env)) or "")
    env = {"KEEP": "1"}
    cluster = demo.start_cluster(str(tmp_path), env, tmp_path / "log", print)
    ((cmd, given),) = envs
    port = next(a for a in cmd if a.startswith("--dashboard-port=")).split("=")[1]
    assert given["RAY_API_SERVER_ADDRESS"] == f"http://127.0.0.1:{port}" == cluster["dashboard"]
    assert given["KEEP"] == "1" and env == {"KEEP": "1"}
