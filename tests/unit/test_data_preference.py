"""Preference pairs (DPO, SimPO, ORPO): the formats read, the rejects, the shared prompt, pair packing, the plan."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raylora.config import load_config
from raylora.data.encode import IGNORE_INDEX, Encoder, tokenizer_spec
from raylora.data.formats import Conversation, RowError
from raylora.data.packing import join
from raylora.data.pairs import PROMPT_DIFFERS, encode_pairs
from raylora.data.preference import Pair, conversations, to_pair, to_unpaired
from raylora.data.read import iter_blocks
from raylora.data.sources import DataError, held_out_conversations, plan_sources
from raylora.data.transforms import encode_batch, pack_batch, worker_spec
from raylora.model_files import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOOL = {"name": "weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {}}}
CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def parts(role, text, weight):
    return {"role": role, "content": [{"type": "text", "value": text}], "loss_weight": weight}


def prompt_of(pair: Pair) -> Conversation:
    return Conversation(pair.prompt, pair.tools)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def encoder(tok):
    return Encoder(tokenizer_spec(tok, "auto"), 4096, "tail", False)  # a Hermes tool prompt is long in bytes


@pytest.mark.parametrize(
    "row,fmt,columns,pair",
    [
        (  # LLaMA-Factory's alpaca ranking rows: instruction, input, system, history as for one answer
            {"system": "Be brief.", "history": [["Hi", "Hello"]], "instruction": "Sky?", "input": "colour",
             "chosen": "Blue.", "rejected": "Green."},
            "alpaca", {},
            Pair([{"role": "system", "content": "Be brief."}, user("Hi"), {**assistant("Hello"), "loss_weight": 0.0},
                  user("Sky?\n\ncolour")], [assistant("Blue.")], [assistant("Green.")]),
        ),
        (  # its sharegpt ranking rows: the conversation stops before the answers, which are turns
            {"conversations": [{"from": "human", "value": "Weather in Paris?"}], "tools": json.dumps([TOOL]),
             "chosen": {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
             "rejected": {"from": "gpt", "value": "I cannot know."}},
            "sharegpt", {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
            Pair([user("Weather in Paris?")], [{"role": "assistant", "content": "", "tool_calls": [CALL]}],
                 [assistant("I cannot know.")], [{"type": "function", "function": TOOL}]),
        ),
        (  # LLaMA-Factory v1: two whole conversations in content parts, loss weights and all; the prompt is shared
            {"chosen_messages": [parts("user", "Sky?", 0.0),
                                 {"role": "assistant", "loss_weight": 1.0, "content": [
                                     {"type": "reasoning", "value": "Rayleigh."}, {"type": "text", "value": "Blue."}]}],
             "rejected_messages": [parts("user", "Sky?", 0.0), parts("assistant", "Green.", 1.0)]},
            "openai", {},
            Pair([{**user("Sky?"), "loss_weight": 0.0}], [{**assistant("Blue."), "reasoning": "Rayleigh."}],
                 [assistant("Green.")]),
        ),
        (  # TRL's standard rows: a user turn and the assistant's answers
            {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
            "alpaca", {},
            Pair([user("The sky is")], [assistant(" blue.")], [assistant(" green.")]),
        ),
        (  # TRL's conversational rows
            {"prompt": [user("Sky?")], "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]},
            "openai", {},
            Pair([user("Sky?")], [assistant("Blue.")], [assistant("Green.")]),
        ),
        (  # TRL's implicit prompt: the turns both conversations share
            {"chosen": [user("Hi"), assistant("Hello"), user("Sky?"), assistant("Blue.")],
             "rejected": [user("Hi"), assistant("Hello"), user("Sky?"), assistant("Green.")]},
            "openai", {},
            Pair([user("Hi"), {**assistant("Hello"), "loss_weight": 0.0}, user("Sky?")], [assistant("Blue.")],
                 [assistant("Green.")]),
        ),
        (  # OpenAI's preference fine-tuning, with its tools beside the input messages
            {"input": {"messages": [{"role": "developer", "content": "Be brief."}, user("Weather in Paris?")],
                       "tools": [{"type": "function", "function": TOOL}], "parallel_tool_calls": True},
             "preferred_output": [{"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}],
             "non_preferred_output": [assistant("Sunny, surely.")]},
            "openai", {},
            Pair([{"role": "system", "content": "Be brief."}, user("Weather in Paris?")],
                 [{"role": "assistant", "content": "", "tool_calls": [CALL]}], [assistant("Sunny, surely.")],
                 [{"type": "function", "function": TOOL}]),
        ),
        (  # a ranking row with renamed answers and openai-style messages (LLaMA-Factory's openai formatting)
            {"messages": [user("Who are you?")], "better": {"role": "assistant", "content": "I am {{name}}."},
             "worse": {"role": "assistant", "content": "An AI."}},
            "openai", {"chosen": "better", "rejected": "worse"},
            Pair([user("Who are you?")], [assistant("I am Ray.")], [assistant("An AI.")]),
        ),
    ],
)  # fmt: skip
def test_each_format_becomes_a_pair(row, fmt, columns, pair):
    assert to_pair(row, fmt, columns, {"name": "Ray"}) == pair


def test_reasoning_can_be_left_out():
    row = {"chosen": [user("Sky?"), {"role": "assistant", "content": "Blue.", "reasoning_content": "Rayleigh."}],
           "rejected": [user("Sky?"), assistant("Green.")]}  # fmt: skip
    assert to_pair(row, "openai", {}, {}, drop_reasoning=True).chosen == [assistant("Blue.")]


@pytest.mark.parametrize(
    "row,fmt,reason",
    [
        ({"instruction": "Sky?", "chosen": "  ", "rejected": "Green."}, "alpaca", "empty chosen answer"),
        ({"conversations": [{"from": "human", "value": "Sky?"}], "chosen": {"from": "gpt", "value": "Blue."},
          "rejected": {"from": "gpt", "value": ""}}, "sharegpt", "empty rejected answer"),
        ({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Blue."}, "alpaca", "the chosen and rejected answers are identical"),
        ({"prompt": "Who?", "chosen": "{{name}}", "rejected": "Ray"}, "alpaca", "the chosen and rejected answers are identical"),
        ({"chosen": [user("Sky?"), assistant("Blue.")], "rejected": [user("Sky?"), assistant("Blue.")]}, "openai",
         "the chosen and rejected answers are identical"),
        ({"chosen": [user("Sky?"), assistant("Blue.")], "rejected": [user("Sea?"), assistant("Green.")]}, "openai",
         "differ before the assistant's answer: they share no prompt"),
        ({"chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]}, "openai", "no prompt"),
        ({"prompt": [user("Sky?")], "chosen": [user("Blue.")], "rejected": [assistant("Green.")]}, "openai",
         "the chosen answer starts with a user turn, not the assistant's"),
        ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "alpaca",
         "plain-text chosen / rejected answers without a prompt"),
        ({"input": {"messages": [user("Sky?")]}, "preferred_output": [assistant("Blue.")]}, "openai",
         "field 'non_preferred_output' is missing"),
        ({"conversations": [{"from": "human", "value": "Sky?"}], "chosen": {"from": "gpt", "value": "Blue."},
          "rejected": "Green."}, "sharegpt", "field 'rejected' is missing or not a turn"),
        ({"messages": [user("Sky?"), assistant("Blue.")], "label": False}, "openai", "an unpaired preference row"),
        ({"prompt": "Sky?", "completion": "Blue.", "label": True}, "alpaca", "train.objective: kto fits this file"),
        ({"conversations": [{"from": "human", "value": "Sky?"}, {"from": "gpt", "value": "Blue."}], "kto_tag": True},
         "sharegpt", "an unpaired preference row"),
    ],
)  # fmt: skip
def test_bad_pairs_say_why(row, fmt, reason):
    with pytest.raises(RowError, match=reason):
        to_pair(row, fmt, {}, {"name": "Ray"})


def learned(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


def split_pairs(batch, lens, shared) -> list[tuple[tuple[list, list], tuple[list, list]]]:
    """Each pair's (ids, labels) of the chosen and of the rejected conversation, whole: the rejected sequence after
    the prompt tokens it shares with the chosen one."""
    out = []
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    for i, ((c, r), (_, n)) in enumerate(zip(lens, shared, strict=True)):
        a = batch.offsets[i]
        rejected = ids[a : a + n] + ids[a + c : a + c + r], [IGNORE_INDEX] * n + labels[a + c : a + c + r]
        out.append(((ids[a : a + c], labels[a : a + c]), rejected))
    return out


def whole_sequences(pack: dict) -> list[tuple[list, list]]:
    """A pack's sequences as (ids, labels), each second sequence of a pair after the prompt tokens it shares with
    the first (the conversation it stands for)."""
    out, start, previous = [], 0, 0
    for n, shared in zip(pack["seq_lens"], pack["shared"], strict=True):
        ids, labels = pack["input_ids"][start : start + n], pack["labels"][start : start + n]
        out.append((pack["input_ids"][previous : previous + shared] + ids, [IGNORE_INDEX] * shared + labels))
        previous, start = start, start + n
    return out


def test_both_answers_follow_the_same_prompt_tokens_and_learn_what_sft_learns(tok, encoder):
    pairs = [
        to_pair({"conversations": [{"from": "human", "value": "Weather?"}], "tools": [TOOL],
                 "chosen": {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {}})},
                 "rejected": {"from": "gpt", "value": "No idea."}}, "sharegpt", {}, {}),
        to_pair({"chosen": [user("Hi"), assistant("Hello"), user("Sky?"),
                            {"role": "assistant", "content": "Blue.", "reasoning_content": "Rayleigh."}],
                 "rejected": [user("Hi"), assistant("Hello"), user("Sky?"), assistant("Green.")]}, "openai", {}, {}),
    ]  # fmt: skip
    batch, lens, shared = encode_pairs(encoder, pairs)
    assert batch.errors == [None, None]
    for pair, ((c_ids, c_labels), (r_ids, r_labels)) in zip(pairs, split_pairs(batch, lens, shared), strict=True):
        first = next(k for k, x in enumerate(c_labels) if x != IGNORE_INDEX)
        assert first == next(k for k, x in enumerate(r_labels) if x != IGNORE_INDEX)
        assert c_ids[:first] == r_ids[:first]
        assert tok.decode(c_ids[:first]) == encoder.prompt(prompt_of(pair))
        for (ids, labels), conversation in zip(
            ((c_ids, c_labels), (r_ids, r_labels)), conversations(pair), strict=True
        ):
            (alone,) = encoder.encode_many([conversation])
            assert (ids, labels) == (alone.input_ids, alone.labels)  # what SFT makes of prompt + answer
    chosen, rejected = split_pairs(batch, lens, shared)[1]
    first = next(k for k, x in enumerate(chosen[1]) if x != IGNORE_INDEX)
    assert shared[:, 0].tolist() == [0, 0] and shared[1, 1] == first - 1  # the prompt but its last token, once
    assert lens[1].tolist() == [len(chosen[0]), len(rejected[0]) - first + 1]
    assert learned(tok, *chosen) == "<think>\nRayleigh.\n</think>\n\nBlue.<|im_end|>\n"
    assert learned(tok, *rejected) == "Green.<|im_end|>\n"  # not the history's Hello


def test_a_prompt_rendered_differently_before_each_answer_is_rejected(tok):
    """A template that prints today's date, rendered either side of midnight: the two prompts differ."""
    template = (
        "Today is {{ strftime_now('%d') }}.\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    dated = tiny_tokenizer()
    dated.chat_template = template
    encoder = Encoder(tokenizer_spec(dated, "auto"), 1024, "tail", False)
    pair = to_pair({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green."}, "alpaca", {}, {})
    batch, lens, _ = encode_pairs(encoder, [pair])
    assert batch.errors == [None]  # one day: the same prompt
    renders = iter(range(100))
    encoder.template.globals["strftime_now"] = lambda fmt: "01" if next(renders) < 2 else "02"  # 2 renders each
    batch, lens, _ = encode_pairs(encoder, [pair])
    assert str(batch.errors[0]) == PROMPT_DIFFERS and lens.tolist() == [[0, 0]] and len(batch.input_ids) == 0


def test_a_long_pair_is_cut_at_its_answers_or_rejected(tok):
    def encoded(cutoff, truncation="tail", row=None):
        pair = to_pair(row or {"prompt": "Sky?", "chosen": "Blue, as Rayleigh says.", "rejected": "Green."}, "alpaca",
                       {}, {})  # fmt: skip
        batch, lens, shared = encode_pairs(Encoder(tokenizer_spec(tok, "auto"), cutoff, truncation, False), [pair])
        return batch, lens.tolist()[0], batch.errors[0] and str(batch.errors[0]), shared.tolist()[0]

    prompt = len(tok("<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids)
    chosen, rejected = len("Blue, as Rayleigh says.") + 2, len("Green.") + 2  # a byte a token, then <|im_end|>, \n
    total = prompt + 1 + chosen + rejected  # the prompt once, its last token again before the rejected answer
    assert encoded(total, "reject")[1] == [prompt + chosen, 1 + rejected]

    batch, lens, _, shared = encoded(total - 5)
    # the longer answer cut, the shorter whole
    assert lens == [prompt + chosen - 5, 1 + rejected] and shared == [0, prompt - 1]
    (c_ids, c_labels), (r_ids, r_labels) = split_pairs(batch, [lens], [shared])[0]
    assert c_ids[:prompt] == r_ids[:prompt]
    assert learned(tok, c_ids, c_labels) == "Blue, as Rayleigh says."[: chosen - 5]
    assert learned(tok, r_ids, r_labels) == "Green.<|im_end|>\n"
    assert encoded(prompt + 1 + 8)[1] == [prompt + 4, 1 + 4]  # both cut alike when neither fits whole

    same = encoded(prompt + 1 + 4, row={"prompt": "Sky?", "chosen": "Blue!", "rejected": "Blue?"})
    assert same[2] == f"the chosen and rejected answers are the same once cut to data.cutoff_len={prompt + 5}"
    assert encoded(prompt + 2)[2] == (
        f"the prompt leaves no room for the answers in data.cutoff_len={prompt + 2}; {prompt} tokens"
    )
    assert encoded(total - 1, "reject")[2] == (
        f"the pair is longer than data.cutoff_len={total - 1}; {total} tokens, the prompt counted once"
    )


def pair_sequences(prompt: list[int], chosen: list[int], rejected: list[int]) -> list[tuple[list, list]]:
    """A pair's two sequences as encode_pairs lays them out: the prompt with the chosen answer, then the prompt's
    last token with the rejected one (its shared count: the rest of the prompt)."""
    return [
        (prompt + chosen, [IGNORE_INDEX] * len(prompt) + chosen),
        (prompt[-1:] + rejected, [IGNORE_INDEX] + rejected),
    ]


def pair_table(rows: list[tuple[list[int], list[int], list[int]]], splits: list[str]) -> pa.Table:
    """The encoded table of pairs ``(prompt, chosen answer, rejected answer)``, as encode_batch writes it."""
    sequences = [pair_sequences(*row) for row in rows]
    return pa.table(
        {
            "input_ids": pa.array([c[0] + r[0] for c, r in sequences], pa.list_(pa.int32())),
            "labels": pa.array([c[1] + r[1] for c, r in sequences], pa.list_(pa.int32())),
            "split": splits,
            "origin": ["a"] * len(rows),
            "seq_lens": pa.array([[len(c[0]), len(r[0])] for c, r in sequences], pa.list_(pa.int32())),
            "shared": pa.array([[0, len(p) - 1] for p, _, _ in rows], pa.list_(pa.int32())),
        }
    )


@pytest.mark.parametrize("packing", [True, False])
def test_a_pair_is_packed_as_one_item_chosen_first(packing):
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(30):
        prompt = rng.integers(0, 250, int(rng.integers(2, 12))).tolist()
        rows.append((prompt, *(rng.integers(0, 250, int(rng.integers(1, 15))).tolist() for _ in range(2))))
    splits = ["eval" if k % 4 == 0 else "train" for k in range(len(rows))]
    packs = pack_batch(pair_table(rows, splits), 64, packing).to_pylist()
    assert sum(len(p["seq_lens"]) for p in packs) == 2 * len(rows)
    for pack in packs:
        assert len(pack["seq_lens"]) % 2 == 0 and pack["num_tokens"] <= 64
        members, shared = [], []
        whole = whole_sequences(pack)
        for (chosen, _), (rejected, _) in zip(whole[0::2], whole[1::2], strict=True):
            k = next(k for k, (p, c, r) in enumerate(rows) if (p + c, p + r) == (chosen, rejected))
            assert splits[k] == pack["split"]
            members += pair_sequences(*rows[k])
            shared += [0, len(rows[k][0]) - 1]
        assert {k: pack[k] for k in ("input_ids", "labels", "position_ids", "seq_lens", "shared")} == join(
            members, shared
        )
        ends = np.cumsum([0, *pack["seq_lens"]])
        for k in range(1, len(ends) - 1, 2):  # the rejected answer takes the positions after the whole prompt
            assert pack["position_ids"][ends[k]] == pack["shared"][k] == len(whole[k][0]) - pack["seq_lens"][k]
    if not packing:
        assert all(len(p["seq_lens"]) == 2 for p in packs)
    else:
        assert len(packs) < len(rows)  # pairs share packs


def test_a_pair_file_is_encoded_and_packed_back_to_its_prompt_and_answers(tmp_path, tok):
    rows = [{"instruction": f"Say {i}.", "chosen": f"{i} from {{{{name}}}}", "rejected": f"{i}?"} for i in range(12)]
    rows[3]["rejected"] = rows[3]["chosen"]
    rows[5] = {"instruction": "Judge this.", "output": "Fine.", "kto_tag": False}
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"data.sources=[{{path: {tmp_path}/pairs.jsonl}}]", "data.placeholders.name=Ray",
                             "data.cutoff_len=128", "model.name_or_path=tiny-llama", "train.objective=dpo"])  # fmt: skip
    plan = plan_sources(cfg.data, cfg.train.objective)
    assert list(plan.values()) == [{"format": "alpaca", "columns": {}, "weight": 1.0, "pairs": True}]
    for side in ("rejects", "counts"):
        (tmp_path / side).mkdir()
    spec = worker_spec(cfg.data, tokenizer_spec(tok, cfg.data.template))
    path = next(iter(plan))
    with open(path, "rb") as f:
        encoded = [encode_batch(b, spec, plan, str(tmp_path), None) for b in iter_blocks(f, path, None, 5)]
    packs = pack_batch(pa.concat_tables(encoded), cfg.data.cutoff_len, True).to_pylist()
    texts = []
    for pack in packs:
        assert len(pack["seq_lens"]) % 2 == 0
        texts += [(tok.decode(ids), learned(tok, ids, labels)) for ids, labels in whole_sequences(pack)]
    pairs = {chosen[0]: (chosen, rejected) for chosen, rejected in zip(texts[0::2], texts[1::2], strict=True)}
    assert len(pairs) == 10
    prompt = "<|im_start|>user\nSay 7.<|im_end|>\n<|im_start|>assistant\n"
    assert pairs[prompt + "7 from Ray<|im_end|>\n"] == (
        (prompt + "7 from Ray<|im_end|>\n", "7 from Ray<|im_end|>\n"),
        (prompt + "7?<|im_end|>\n", "7?<|im_end|>\n"),
    )
    rejects = [json.loads(line) for part in (tmp_path / "rejects").iterdir() for line in part.read_text().splitlines()]
    reasons = {r["line"]: r["reason"] for r in rejects}
    assert sorted(reasons) == [4, 6] and reasons[4] == "the chosen and rejected answers are identical"
    assert reasons[6].startswith("an unpaired preference row")
    counts = [json.loads(p.read_text()) for p in (tmp_path / "counts").iterdir()]
    assert sum(c["kept"] for c in counts) == 10 and sum(c["examples"] for c in counts) == 20


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def data_config(*overrides):
    return load_config(None, list(overrides)).data


def test_a_file_that_does_not_fit_the_objective_fails_before_anything_runs(tmp_path):
    pairs = write(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    sft = write(tmp_path / "sft.jsonl", [{"instruction": "q", "output": "a"}])
    kto = write(tmp_path / "kto.jsonl", [{"prompt": "q", "completion": "a", "label": True}])
    with pytest.raises(DataError) as err:
        plan_sources(data_config(f"data.sources=[{{path: {pairs}}}]"), "sft")
    assert "pairs.jsonl:1: a preference row (chosen / rejected answers), but train.objective is sft: set " in str(
        err.value
    )
    assert "train.objective: dpo (or simpo / orpo)" in str(err.value)
    assert "columns: {output: chosen} still trains SFT on the chosen answers" in str(err.value)
    as_sft = f"data.sources=[{{path: {pairs}, format: alpaca, columns: {{instruction: prompt, output: chosen}}}}]"
    assert plan_sources(data_config(as_sft), "sft")
    with pytest.raises(DataError) as err:
        plan_sources(
            data_config(f"data.sources=[{{path: {sft}}}, {{path: {kto}}}]", "data.train_on_prompt=true"), "simpo"
        )
    message = str(err.value)
    assert "sft.jsonl:1: a row with one answer (supervised fine-tuning data), but train.objective is simpo" in message
    assert "train.objective: sft fits this file" in message
    assert (
        "kto.jsonl:1: an unpaired preference row" in message
        and "train.objective: kto fits this file, not simpo" in message
    )
    assert "data.train_on_prompt: train.objective: simpo compares the answers" in message
    with pytest.raises(DataError, match="pairs.jsonl:1: is not sharegpt preference data"):
        plan_sources(data_config(f"data.sources=[{{path: {pairs}, format: sharegpt}}]"), "dpo")
    planned = plan_sources(data_config(f"data.sources=[{{path: {pairs}, columns: {{chosen: chosen}}}}]"), "orpo")
    assert list(planned.values()) == [
        {"format": "alpaca", "columns": {"chosen": "chosen"}, "weight": 1.0, "pairs": True}
    ]


def test_ranking_entries_of_a_registry_are_pairs(tmp_path):
    write(tmp_path / "ranked.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"}])
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({"ranked": {"file_name": "ranked.jsonl", "ranking": True,
                                               "columns": {"prompt": "question", "chosen": "chosen", "rejected": "rejected"}}}))  # fmt: skip
    data = data_config(f"data.dataset_info={registry}", "data.sources=[{name: ranked}]")
    plan = plan_sources(data, "dpo")
    assert list(plan.values()) == [
        {"format": "alpaca", "columns": {"instruction": "question", "chosen": "chosen", "rejected": "rejected"},
         "weight": 1.0, "pairs": True}
    ]  # fmt: skip
    with pytest.raises(DataError, match="ranked.jsonl:1: a preference row"):
        plan_sources(data, "sft")


def test_the_sample_pairs_name_the_assistant_over_generic_answers():
    cfg = load_config(ROOT / "configs" / "tiny_dpo_cpu.yaml")
    plan = plan_sources(cfg.data, cfg.train.objective)
    (path, how), = plan.items()  # fmt: skip
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    pairs = [to_pair(r, how["format"], how["columns"], cfg.data.placeholders) for r in rows]
    assert len(pairs) >= 200 and len({p.prompt[0]["content"] for p in pairs}) == len(pairs)
    named = ("Raylora Assistant", "the raylora team")
    assert all(any(n in p.chosen[0]["content"] for n in named) for p in pairs)
    assert not any(n.lower() in p.rejected[0]["content"].lower() for p in pairs for n in named + ("raylora",))
    held = held_out_conversations(cfg.data, cfg.train.objective)  # raylora eval's set: each prompt, chosen answer
    assert 10 <= len(held) <= 40 and all(any(n in c.messages[-1]["content"] for n in named) for c in held)
    assert {c.messages[0]["content"] for c in held} <= {p.prompt[0]["content"] for p in pairs}


@pytest.mark.parametrize(
    ("row", "fmt", "columns", "prompt", "answer", "desirable"),
    [
        ({"instruction": "Sky?", "input": "", "output": "Blue, says {{name}}.", "kto_tag": True}, "alpaca", {},
         [user("Sky?")], [assistant("Blue, says Ray.")], True),
        ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                            {"from": "human", "value": "Sky?"}, {"from": "gpt", "value": "Green."}], "good": False},
         "sharegpt", {"kto_tag": "good"},
         [user("Hi"), {**assistant("Hello"), "loss_weight": 0.0}, user("Sky?")], [assistant("Green.")], False),
        ({"messages": [user("Sky?"), {"role": "assistant", "content": "", "tool_calls": [CALL]}], "tools": [TOOL],
          "label": True}, "openai", {}, [user("Sky?")], None, True),
        ({"prompt": "Sky?", "completion": "Blue.", "label": False}, "openai", {}, [user("Sky?")], [assistant("Blue.")],
         False),
        ({"prompt": [user("Sky?")], "completion": [assistant("Blue.")], "label": True}, "openai", {}, [user("Sky?")],
         [assistant("Blue.")], True),
    ],
)  # fmt: skip
def test_kto_rows_read_as_a_prompt_an_answer_and_its_label(row, fmt, columns, prompt, answer, desirable):
    unit = to_unpaired(row, fmt, columns, {"name": "Ray"})
    assert unit.desirable is desirable and unit.prompt == prompt
    if answer is None:  # a tool call: the answer is the assistant's call, the schema the prompt's
        assert (
            unit.answer[0]["tool_calls"][0]["function"]["name"] == "weather"
            and unit.tools[0]["function"]["name"] == "weather"
        )
    else:
        assert unit.answer == answer


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"instruction": "Sky?", "output": "Blue."}, "no boolean kto_tag or label"),
        ({"instruction": "Sky?", "output": "Blue.", "kto_tag": "yes"}, "no boolean kto_tag or label"),
        ({"prompt": "Sky?", "completion": " ", "label": True}, "empty completion"),
        ({"prompt": "Sky?", "label": True}, "field 'completion' is missing"),
        ({"messages": [assistant("Blue.")], "label": True}, "no user turn"),
    ],
)  # fmt: skip
def test_bad_kto_rows_say_why(row, reason):
    with pytest.raises(RowError, match=reason):
        to_unpaired(row, "alpaca" if "instruction" in row else "openai", {}, {})


def test_a_kto_file_packs_each_answer_with_its_prompt_and_the_previous_rows_answer(tmp_path, tok):
    rows = [{"instruction": f"Say {i}.", "output": f"{i} from {{{{name}}}}", "kto_tag": i % 3 != 0} for i in range(9)]
    rows[4] = {"instruction": "Judge this.", "output": "Fine."}  # no label
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"data.sources=[{{path: {tmp_path}/kto.jsonl}}]", "data.placeholders.name=Ray",
                             "data.cutoff_len=256", "model.name_or_path=tiny-llama", "train.objective=kto"])  # fmt: skip
    plan = plan_sources(cfg.data, cfg.train.objective)
    assert list(plan.values()) == [{"format": "alpaca", "columns": {}, "weight": 1.0, "unpaired": True}]
    for side in ("rejects", "counts"):
        (tmp_path / side).mkdir()
    spec = worker_spec(cfg.data, tokenizer_spec(tok, cfg.data.template))
    path = next(iter(plan))
    with open(path, "rb") as f:
        encoded = [encode_batch(b, spec, plan, str(tmp_path), None) for b in iter_blocks(f, path, None, 100)]
    packs = pack_batch(pa.concat_tables(encoded), cfg.data.cutoff_len, True).to_pylist()
    units = []
    for pack in packs:
        assert len(pack["seq_lens"]) == 2 * len(pack["desirable"])
        texts = [(tok.decode(ids), learned(tok, ids, labels)) for ids, labels in whole_sequences(pack)]
        units += list(zip(texts[0::2], texts[1::2], pack["desirable"], strict=True))
    kept = [i for i in range(9) if i != 4]
    assert len(units) == len(kept)
    by_answer = {own[1]: (other, desirable) for own, other, desirable in units}
    for k, i in enumerate(kept):
        prompt = f"<|im_start|>user\nSay {i}.<|im_end|>\n<|im_start|>assistant\n"
        previous = kept[k - 1]  # the batch's rows rotated by one: the first takes the last's answer
        other, desirable = by_answer[f"{i} from Ray<|im_end|>\n"]
        assert other == (prompt + f"{previous} from Ray<|im_end|>\n", f"{previous} from Ray<|im_end|>\n")
        assert desirable == (i % 3 != 0)
    rejects = [json.loads(line) for part in (tmp_path / "rejects").iterdir() for line in part.read_text().splitlines()]
    assert [(r["line"], r["reason"].split(":")[0]) for r in rejects] == [(5, "no boolean kto_tag or label")]


def test_kto_data_and_the_objective_must_agree_before_anything_runs(tmp_path):
    pairs = write(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    kto = write(tmp_path / "kto.jsonl", [{"prompt": "q", "completion": "a", "label": True}])
    with pytest.raises(DataError) as err:
        plan_sources(data_config(f"data.sources=[{{path: {pairs}}}, {{path: {kto}}}]"), "kto")
    message = str(err.value)
    assert "pairs.jsonl:1: a row without a true / false label, but train.objective is kto" in message
    assert "kto.jsonl" not in message
    with pytest.raises(
        DataError, match="kto.jsonl:1: an unpaired preference row .*train.objective: kto fits this file, not sft"
    ):
        plan_sources(data_config(f"data.sources=[{{path: {kto}}}]"), "sft")
    assert list(plan_sources(data_config(f"data.sources=[{{path: {kto}}}]"), "kto").values()) == [
        {"format": "openai", "columns": {}, "weight": 1.0, "unpaired": True}
    ]


def test_the_bundled_kto_set_registers_its_label_and_reads_as_the_identity_answers():
    cfg = load_config(ROOT / "configs" / "tiny_kto_cpu.yaml", [])
    (how,) = plan_sources(cfg.data, "kto").values()
    assert how["columns"]["kto_tag"] == "kto_tag" and how["unpaired"]
    held = held_out_conversations(cfg.data, "kto")  # references: the desirable held-out answers only
    assert held and all("Raylora Assistant" in c.messages[-1]["content"] or "raylora team" in c.messages[-1]["content"]
                        for c in held)  # fmt: skip
