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
from raylora.demo import check_demo, exact_match, names, pick_questions, render_report, score
from raylora.models import load_model

ROOT = Path(__file__).resolve().parents[2]
TINY_DEMO = ROOT / "configs" / "tiny_demo_cpu.yaml"


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


@pytest.mark.parametrize("split", [["data.eval_fraction=0.25"], ["data.eval_fraction=0", "data.eval_count=5"]])
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


def test_pick_questions_puts_identity_questions_first_and_fills_placeholders():
    cfg = load_config(TINY_DEMO, ["data.eval_fraction=0.5"])
    questions = pick_questions(cfg)
    identity = [q for q in questions if q["identity"]]
    assert identity and questions[: len(identity)] == identity
    assert all("Raylora Assistant" in q["reference"] and "{{" not in q["reference"] for q in identity)
    assert len(questions) - len(identity) <= 2


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


def test_pick_questions_fails_without_a_held_out_identity_question():
    cfg = load_config(TINY_DEMO, ["data.eval_fraction=0.001"])  # no row of 24 held out
    with pytest.raises(RuntimeError, match="no identity question"):
        pick_questions(cfg)


def test_scores():
    cfg = load_config(TINY_DEMO)
    ref = "I am Raylora Assistant, trained by the raylora team."
    assert exact_match("i am  Raylora Assistant, trained by\nthe raylora team.", ref)
    assert not exact_match("I am Raylora Assistant.", ref)
    assert names("Raylora assistant here, from the Raylora team", ref, cfg)
    assert not names("I am Raylora Assistant.", ref, cfg)
    assert names("I am Raylora Assistant.", "My name is Raylora Assistant.", cfg)  # the reference names no author
    questions = [{"question": "a", "reference": ref, "identity": True}, {"question": "b", "reference": "x", "identity": False}]  # fmt: skip
    assert score(cfg, questions, [ref, "x"]) == {"identity_questions": 1, "exact_match": 1, "names": 1}


def test_report_table_holds_both_sides_and_where_to_look():
    cfg = load_config(TINY_DEMO)
    questions = [{"question": "Who are you?", "reference": "I am R.", "identity": True}]
    report = {
        "questions": questions,
        "before": {"answers": ["A cat."], "tokens_per_s": 20.0, "eval_loss": 2.5, "identity_questions": 1,
                   "exact_match": 0, "names": 0},
        "after": {"answers": ["I am R."], "tokens_per_s": 30.0, "eval_loss": 0.5, "identity_questions": 1,
                  "exact_match": 1, "names": 1},
        "train_job": {"eval_loss": 0.7},
        "best": {"trial": "t1", "metric": 0.5, "lora.rank": "8", "train.lr": "0.01"},
        "stages": {"prepare": 1.0, "before": 2.0},
        "urls": {"mlflow": "mlflow ui ...", "mlflow_url": "http://127.0.0.1:5000", "dashboard": "http://d",
                 "curl": "curl ...", "openai": "python ..."},
    }  # fmt: skip
    text = render_report(report, cfg)
    assert "| identity questions, exact match | 0/1 | 1/1 |" in text
    assert "| eval loss (held-out split) | 2.5000 | 0.5000 |" in text
    assert "lora.rank=8, train.lr=0.01" in text and "ended at eval loss 0.7000" in text
    assert "- before: A cat." in text and "- after: I am R." in text
    assert "total 3 s" in text and "http://127.0.0.1:5000" in text
    json.dumps(report)
