import pytest

from raylora.data.encode import IGNORE_INDEX, Encoded, Encoder, tokenizer_spec
from raylora.data.formats import RowError
from raylora.model_files import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def learned(tok, e: Encoded) -> str:
    return tok.decode([i for i, lab in zip(e.input_ids, e.labels, strict=True) if lab != IGNORE_INDEX])


CHAT = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "a2"},
]


def test_every_assistant_turn_is_learned_and_nothing_else(tok):
    (e,) = Encoder(tokenizer_spec(tok, "auto"), 1024, "tail", False).encode_many([CHAT])
    assert tok.decode(e.input_ids) == tok.apply_chat_template(CHAT, tokenize=False)
    assert learned(tok, e) == "a1<|im_end|>\na2<|im_end|>\n"


def test_train_on_prompt_learns_everything(tok):
    (e,) = Encoder(tokenizer_spec(tok, "auto"), 1024, "tail", True).encode_many([CHAT])
    assert e.labels == e.input_ids


def test_alpaca_fallback_template(tok):
    (e,) = Encoder(tokenizer_spec(tok, "alpaca"), 1024, "tail", False).encode_many([CHAT[1:3]])
    assert tok.decode(e.input_ids) == "### Instruction:\nq1\n\n### Response:\na1<|im_end|>\n\n"
    assert learned(tok, e) == "a1<|im_end|>\n\n"


def test_tokenizer_without_template_falls_back_to_chatml(tok):
    bare = tiny_tokenizer()
    bare.chat_template = None
    encoder = Encoder(tokenizer_spec(bare, "auto"), 1024, "tail", False)
    assert encoder.template_name == "chatml"
    (e,) = encoder.encode_many([CHAT])
    assert learned(tok, e) == "a1<|im_end|>\na2<|im_end|>\n"


def test_text_rows_learn_everything_and_end_with_eos(tok):
    (e,) = Encoder(tokenizer_spec(tok, "auto"), 1024, "tail", False).encode_many([[{"role": "text", "content": "abc"}]])
    assert tok.decode(e.input_ids) == "abc<|im_end|>" and e.labels == e.input_ids


def test_truncation_policies(tok):
    long = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y" * 10}]
    (cut,) = Encoder(tokenizer_spec(tok, "auto"), 72, "tail", False).encode_many([long])
    assert len(cut.input_ids) == 72 and learned(tok, cut) == "y" * 3
    (rejected,) = Encoder(tokenizer_spec(tok, "auto"), 72, "reject", False).encode_many([long])
    assert isinstance(rejected, RowError) and str(rejected) == "longer than data.cutoff_len=72; 81 tokens"
    (gone,) = Encoder(tokenizer_spec(tok, "auto"), 20, "tail", False).encode_many([long])
    assert isinstance(gone, RowError) and "no response token is left" in str(gone)


def test_a_batch_keeps_rows_in_order(tok):
    rows = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(5)]
    results = Encoder(tokenizer_spec(tok, "auto"), 1024, "tail", False).encode_many(rows)
    assert [learned(tok, r) for r in results] == [f"a{i}<|im_end|>\n" for i in range(5)]


def test_flat_batch_gives_rejected_rows_no_tokens_and_keeps_the_others_exact(tok):
    ok = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    long = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y" * 10}]
    encoder = Encoder(tokenizer_spec(tok, "auto"), 72, "reject", False)
    batch = encoder.encode_arrays([ok, long, ok])
    assert [e is None for e in batch.errors] == [True, False, True]
    assert batch.offsets[2] == batch.offsets[1]
    (alone,) = encoder.encode_many([ok])
    for a, b in ((0, 1), (2, 3)):
        span = slice(batch.offsets[a], batch.offsets[b])
        assert batch.input_ids[span].tolist() == alone.input_ids
        assert batch.labels[span].tolist() == alone.labels


def test_an_empty_batch_encodes_to_nothing(tok):
    batch = Encoder(tokenizer_spec(tok, "auto"), 72, "tail", False).encode_arrays([])
    assert (batch.input_ids.size, batch.labels.size, batch.offsets.tolist(), batch.errors) == (0, 0, [0], [])
