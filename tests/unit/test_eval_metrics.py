"""raylora eval's scores on hand-made rows: exact match, key strings, LLaMA-Factory's ROUGE/BLEU, tool calls, means."""

import jieba
import pytest
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
from rouge_chinese import Rouge

from raylora.config import METRICS
from raylora.eval.metrics import means, row_keys, score_row, similarity

ALL = list(METRICS)
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def llama_factory(predict: str, label: str) -> dict[str, float]:
    """LLaMA-Factory's own computation (scripts/eval_bleu_rouge.py, ComputeSimilarity), line for line."""
    hypothesis = list(jieba.cut(predict))
    reference = list(jieba.cut(label))
    bleu_score = sentence_bleu([list(label)], list(predict), smoothing_function=SmoothingFunction().method3)
    if len(" ".join(hypothesis).split()) == 0 or len(" ".join(reference).split()) == 0:
        result = {"rouge-1": {"f": 0.0}, "rouge-2": {"f": 0.0}, "rouge-l": {"f": 0.0}}
    else:
        result = Rouge().get_scores(" ".join(hypothesis), " ".join(reference))[0]
    metric_result = {k: round(v["f"] * 100, 4) for k, v in result.items()}
    metric_result["bleu-4"] = round(bleu_score * 100, 4)
    return metric_result


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        (
            "I am Raylora Assistant, trained by the raylora team.",
            "I am Raylora Assistant, an assistant by the raylora team.",
        ),
        ("The capital of France is Paris.", "Paris is the capital of France."),
        ("我是Raylora助手，由raylora团队训练。", "我是Raylora助手，一个由raylora团队微调的模型。"),
        ("今天天气很好", "今天天气很好"),
        ("", "Something to say."),
        ("   ", "空白"),
        ("完全不同的句子", "An English reference"),
    ],
)
def test_rouge_and_bleu_equal_llama_factorys_computation(answer, reference):
    assert similarity(answer, reference) == llama_factory(answer, reference)


def test_chinese_text_scores_by_words_not_dropped():
    same = similarity("我是助手", "我是助手")
    assert same["rouge-1"] == same["rouge-l"] == 100.0 and same["bleu-4"] > 99
    assert similarity("我是助手", "你是谁")["rouge-1"] < 100


def test_exact_match_ignores_case_and_runs_of_whitespace():
    row = score_row("i am  Raylora\nAssistant.", "I am Raylora Assistant.", None, None, [], 5, ["exact_match"])
    assert row == {"exact_match": 1.0}
    assert score_row("I am Raylora.", "I am Raylora Assistant.", None, None, [], 3, ["exact_match"]) == {
        "exact_match": 0.0
    }


def test_keys_come_from_the_list_and_the_pattern_and_contains_needs_all():
    reference = "I am Raylora Assistant, made by the raylora team in 2026."
    keys = row_keys(reference, ["raylora assistant", "The Raylora Team", "Nobody"], r"\d{4}")
    assert keys == ["raylora assistant", "The Raylora Team", "2026"]
    assert (
        score_row("RAYLORA ASSISTANT of the raylora team, 2026", reference, None, None, keys, 9, ALL)["contains"] == 1.0
    )
    assert score_row("Raylora Assistant, 2026", reference, None, None, keys, 9, ALL)["contains"] == 0.0
    assert score_row("anything", "a reference without keys", None, None, [], 1, ALL)["contains"] is None


def test_tool_calls_score_name_arguments_and_json():
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]
    right = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}\n</tool_call>'
    row = score_row(right, "ref", calls, WEATHER, [], 20, ALL)
    assert (row["tool_name"], row["tool_args"], row["tool_json"]) == (1.0, 1.0, 1.0)
    wrong_args = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
    row = score_row(wrong_args, "ref", calls, WEATHER, [], 20, ALL)
    assert (row["tool_name"], row["tool_args"], row["tool_json"]) == (1.0, 0.0, 1.0)
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    row = score_row(broken, "ref", calls, WEATHER, [], 20, ALL)
    assert (row["tool_name"], row["tool_args"], row["tool_json"]) == (0.0, 0.0, 0.0)
    bare = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'  # Llama 3's bare JSON call
    assert score_row(bare, "ref", calls, WEATHER, [], 20, ALL)["tool_args"] == 1.0
    text = score_row("It is sunny.", "ref", calls, WEATHER, [], 4, ALL)
    assert (text["tool_name"], text["tool_json"]) == (0.0, 0.0)
    plain = score_row("It is sunny.", "It is sunny.", None, WEATHER, [], 4, ALL)
    assert plain["tool_name"] is None and plain["tool_args"] is None and plain["tool_json"] is None
    assert plain["length"] == 4.0


def test_means_are_per_candidate_and_per_source_over_the_rows_each_metric_covers():
    rows = [
        {"candidate": "base", "source": "a.json", "scores": {"exact_match": 1.0, "contains": None, "length": 4.0}},
        {"candidate": "base", "source": "b.json", "scores": {"exact_match": 0.0, "contains": 1.0, "length": 8.0}},
        {"candidate": "lora", "source": "a.json", "scores": {"exact_match": 0.0, "contains": None, "length": 2.0}},
    ]
    got = means(rows, ["exact_match", "contains", "length"])
    assert got["base"]["metrics"] == {"exact_match": 0.5, "contains": 1.0, "length": 6.0}
    assert got["base"]["covered"] == {"exact_match": 2, "contains": 1, "length": 2}
    assert got["base"]["sources"] == {"a.json": {"exact_match": 1.0, "length": 4.0},
                                      "b.json": {"exact_match": 0.0, "contains": 1.0, "length": 8.0}}  # fmt: skip
    assert got["base"]["source_rows"] == {"a.json": 1, "b.json": 1}
    assert got["lora"]["metrics"] == {"exact_match": 0.0, "length": 2.0} and got["lora"]["rows"] == 1
