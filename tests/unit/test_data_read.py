import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylora.config import DataArgs, SourceArgs
from raylora.data.pipeline import DataError, plan_sources
from raylora.data.read import expand, first_row, iter_blocks, iter_raw


def rows_of(path):
    with open(path, "rb") as f:
        return list(iter_raw(f, str(path)))


def test_jsonl_lines_blank_lines_and_undecodable_text(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": "\xff"}\n{"a": 3}')
    rows = rows_of(path)
    assert [(line, raw) for line, raw, _ in rows] == [(1, '{"a": 1}'), (3, None), (4, '{"a": 3}')]
    assert rows[1][2].startswith("undecodable text (not UTF-8")


def test_json_array_rows_carry_the_line_they_start_on(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"a": 1},\n  {"a": "x\\ny",\n   "b": [1, 2]},\n\n  {"a": 3}\n]\n')
    rows = rows_of(path)
    assert [(line, json.loads(raw)) for line, raw, _ in rows] == [
        (2, {"a": 1}),
        (3, {"a": "x\ny", "b": [1, 2]}),
        (6, {"a": 3}),
    ]


def test_json_array_is_streamed_in_chunks(tmp_path, monkeypatch):
    import raylora.data.read as read

    monkeypatch.setattr(read, "CHUNK", 7)
    path = tmp_path / "a.json"
    rows = [{"instruction": f"q{i}", "output": "é" * i} for i in range(20)]
    path.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    assert [json.loads(raw) for _, raw, _ in rows_of(path)] == rows


def test_broken_json_array_fails_at_the_offending_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n{"a": 1},\n{"a": oops},\n{"a": 3}\n]')
    with pytest.raises(ValueError, match=r"a.json: not valid JSON at line 3"):
        rows_of(path)
    (tmp_path / "b.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="must hold a JSON array"):
        rows_of(tmp_path / "b.json")


def test_parquet_and_csv_rows(tmp_path):
    pq.write_table(pa.table({"instruction": ["a", "b"], "output": ["x", "y"]}), tmp_path / "a.parquet")
    (tmp_path / "b.csv").write_text('instruction,input,output\nhi,,there\n"multi\nline",x,y\n')
    (tmp_path / "sums.csv").write_text("instruction,output\nwhat is 2+3,5\nwhat is 1+1,2\n")
    assert [(line, json.loads(raw)) for line, raw, _ in rows_of(tmp_path / "a.parquet")] == [
        (1, {"instruction": "a", "output": "x"}),
        (2, {"instruction": "b", "output": "y"}),
    ]
    csv_rows = [json.loads(raw) for _, raw, _ in rows_of(tmp_path / "b.csv")]
    assert csv_rows == [
        {"instruction": "hi", "input": "", "output": "there"},
        {"instruction": "multi\nline", "input": "x", "output": "y"},
    ]
    sums = [json.loads(raw) for _, raw, _ in rows_of(tmp_path / "sums.csv")]  # text, as the file holds it (was int)
    assert sums == [{"instruction": "what is 2+3", "output": "5"}, {"instruction": "what is 1+1", "output": "2"}]
    (tmp_path / "latin1.csv").write_bytes(b"instruction,output\ncaf\xe9,x\nok,y\n")  # one row not UTF-8
    (bad, raw, error), good = rows_of(tmp_path / "latin1.csv")
    assert (bad, raw) == (1, None) and error.startswith("undecodable text") and json.loads(good[1])["output"] == "y"


def test_parquet_struct_rows_do_not_gain_each_others_keys(tmp_path):
    """Found by use: Parquet merges struct fields over rows, and row 1's tool schema showed row 2's parameter."""
    tools = [
        [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        [{"name": "set_timer", "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}}}],
    ]
    pq.write_table(
        pa.table({"messages": [[{"role": "user", "content": "q"}]] * 2, "tools": tools}), tmp_path / "t.parquet"
    )
    rows = [json.loads(raw) for _, raw, _ in rows_of(tmp_path / "t.parquet")]
    assert [r["tools"] for r in rows] == tools


def test_a_byte_order_mark_opening_a_jsonl_file_is_not_part_of_its_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    assert [(line, raw) for line, raw, _ in rows_of(path)] == [(1, '{"a": 1}'), (2, '{"a": 2}')]


def test_a_file_named_twice_and_preference_data_are_refused_before_anything_runs(tmp_path):
    """Found by use: a file named by two sources was read once, with the last source's weight and columns; a
    preference file's rows were trained as if their prompt were the lesson."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    ranked = {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "y"},
              "rejected": {"from": "gpt", "value": "n"}}  # fmt: skip
    (tmp_path / "ranked.jsonl").write_text(json.dumps(ranked) + "\n")
    data = DataArgs(sources=[SourceArgs(str(tmp_path / "d" / "a.jsonl"), weight=3.0), SourceArgs(str(tmp_path / "d")),
                             SourceArgs(str(tmp_path / "ranked.jsonl"))])  # fmt: skip
    with pytest.raises(DataError) as err:
        plan_sources(data)
    assert "a.jsonl is read by data.sources[0] and data.sources[1]" in str(err.value)
    assert "ranked.jsonl:1: a preference row (chosen / rejected answers)" in str(err.value)


def test_blocks_and_row_limit(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": str(i)}) + "\n" for i in range(10)))
    with open(path, "rb") as f:
        blocks = list(iter_blocks(f, str(path), max_rows=7, rows_per_block=3))
    assert [b.num_rows for b in blocks] == [3, 3, 1]
    assert blocks[0].column_names == ["source", "line", "raw", "error"]
    assert blocks[2].column("line").to_pylist() == [7]


def test_expand_file_folder_glob_and_missing(tmp_path):
    for name in ("b.jsonl", "a.json", "notes.txt"):
        (tmp_path / name).write_text("[]")
    assert expand(str(tmp_path)) == [str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")]
    assert expand(str(tmp_path / "*.jsonl")) == [str(tmp_path / "b.jsonl")]
    with pytest.raises(FileNotFoundError, match="matches no data file"):
        expand(str(tmp_path / "nothing*.json"))


def test_first_row(tmp_path):
    (tmp_path / "a.jsonl").write_text('\n{"text": "x"}\n')
    assert first_row(str(tmp_path / "a.jsonl")) == (2, {"text": "x"})
    (tmp_path / "b.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"b.jsonl:1: not valid JSON"):
        first_row(str(tmp_path / "b.jsonl"))


def test_plan_detects_formats_and_reports_every_problem_at_once(tmp_path):
    (tmp_path / "alpaca.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    (tmp_path / "odd.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    (tmp_path / "broken.jsonl").write_text("{oops\n")
    good = plan_sources(
        DataArgs(
            sources=[SourceArgs(str(tmp_path / "alpaca.jsonl")), SourceArgs(str(tmp_path / "chat.jsonl"), weight=2.0)]
        )
    )
    assert {p.rsplit("/", 1)[1]: v["format"] for p, v in good.items()} == {
        "alpaca.jsonl": "alpaca",
        "chat.jsonl": "openai",
    }
    assert good[str(tmp_path / "chat.jsonl")]["weight"] == 2.0

    bad = DataArgs(
        sources=[
            SourceArgs(str(tmp_path / "chat.jsonl"), format="alpaca"),
            SourceArgs(str(tmp_path / "odd.jsonl")),
            SourceArgs(str(tmp_path / "broken.jsonl")),
            SourceArgs(str(tmp_path / "missing.jsonl")),
            SourceArgs(str(tmp_path / "alpaca.jsonl"), format="alpaca", columns={"answer": "x"}),
        ]
    )
    with pytest.raises(DataError) as err:
        plan_sources(bad)
    message = str(err.value)
    assert "chat.jsonl:1: is not alpaca data: the first row has keys messages, not 'instruction'" in message
    assert "odd.jsonl:1: cannot tell the format from the first row (keys: foo)" in message
    assert "broken.jsonl:1: not valid JSON" in message
    assert "missing.jsonl matches no data file" in message
    assert "data.sources[4].columns: unknown field answer" in message
    with pytest.raises(DataError, match="data.sources is empty"):
        plan_sources(DataArgs())


def test_a_folders_upper_case_files_are_read_and_compressed_ones_refused(tmp_path):
    """Found by use: C.JSONL and d.jsonl.gz in a folder were skipped without a word."""
    (tmp_path / "C.JSONL").write_text('{"text": "x"}\n')
    (tmp_path / "a.json").write_text("[]")
    assert expand(str(tmp_path)) == [str(tmp_path / "C.JSONL"), str(tmp_path / "a.json")]
    with open(tmp_path / "C.JSONL", "rb") as f:
        assert [raw for _, raw, _ in iter_raw(f, str(tmp_path / "C.JSONL"))] == ['{"text": "x"}']
    (tmp_path / "d.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(ValueError, match=r"d.jsonl.gz.*compressed.*decompress"):
        expand(str(tmp_path))
    with pytest.raises(ValueError, match=r"d.jsonl.gz.*compressed"):
        expand(str(tmp_path / "d.jsonl.gz"))
