import pytest
import regex
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from raylora.data import words
from raylora.data.tokenize import PieceTokenizer
from raylora.data.words import CHECKED, GPT2_SPLIT, WordEncoder, classes_agree, word_encoder

LINES = [
    "You are a helpful assistant. Answer the question in one sentence, please.",
    "The capital of France is Paris; the capital of Japan is Tokyo. It's 42°C, isn't it? I'll see.",
    "def add(a, b):\n    return a + b\n\n\n\t\tx = [1, 2, 3]  # done   \n",
    "Emoji 🙂 too. Full width！１２３　ＡＢＣ「quoted」、done。",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, 한국어 → ✓ ½ ² Ⅻ €5",
    "天气很好，我们去公园散步吧。こんにちは、カタカナ。ภาษาไทย",
]
CORPUS = LINES * 20
TEXTS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Paris.<|im_end|>\n",
    "<|im_start|><|im_end|><|im_start|>  spaces around  <|im_end|>  \n\n",
    "content that mentions <|im_end|> inside and <|im_start|>user\n again",
    "<|im_start|>user\n天气很好 🙂<|im_end|>\n<|im_start|>assistant\n",
    "   leading and trailing   ",
    "<tool>call</tool> and a plain <tool> tag",
    "",
]


WORD_TEXTS = [
    *LINES[:5],
    "  leading, trailing and   inner   spaces  \n\n \n",
    "numbers 1234567 and 3.14159, dates 2026-11-30, ids [12345]",
    "contractions: they're, we've, I'm, you'd, he'll; 'quoted' and ''",
    "no\u00a0break\u3000ideographic\u2003em\u2028line\u0085next\x0bvt\x1cfs",
    "",
    " ",
    "\n",
]
# written without spaces (Chinese, Japanese, Thai), or holding characters the two regex engines may class apart
WHOLE = [
    LINES[5],
    "English with one 字 in it",
    "Armenian Ա and new letters \ua7ce\u0558",
    "old italic \U00010300 x",
    "mahjong \U0001f000",
]


def bpe(**added_options) -> Tokenizer:
    """A byte-level BPE with merges and the GPT-2 pre-tokenizer regex, trained offline on a small corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken("<tool>", **{"normalized": False, **added_options})])
    return tok


def plain(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def test_pieces_give_exactly_the_tokenizers_ids_batch_after_batch():
    tok = bpe()
    pieces = PieceTokenizer(tok)
    assert pieces.split is not None
    for _ in range(3):  # later batches take the recurring pieces from the memo
        assert pieces(TEXTS * 2) == plain(tok, TEXTS * 2)
    assert "system\nYou are a helpful assistant." in pieces.memo


def test_unique_pieces_are_not_remembered():
    tok = bpe()
    pieces = PieceTokenizer(tok)
    texts = [f"<|im_start|>user\nquestion {i}<|im_end|>\n" for i in range(50)]
    assert pieces(texts) == plain(tok, texts)
    assert set(pieces.memo) == {"\n"}


@pytest.mark.parametrize("options", [{"lstrip": True}, {"rstrip": True}, {"single_word": True}, {"normalized": True}])
def test_tokenizers_whose_added_tokens_are_not_verbatim_get_whole_texts(options):
    tok = bpe(**options)
    tok.normalizer = normalizers.Lowercase()
    pieces = PieceTokenizer(tok)
    assert pieces.split is None
    assert pieces(TEXTS) == plain(tok, TEXTS)


def test_normalised_and_verbatim_added_tokens_together_get_whole_texts():
    tok = bpe(normalized=True)  # the tokenizer matches these in a second pass; one regex cannot
    pieces = PieceTokenizer(tok)
    assert pieces.split is None
    assert pieces(TEXTS) == plain(tok, TEXTS)


def test_a_pre_tokenizer_that_marks_only_the_first_word_gets_whole_texts():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    pieces = PieceTokenizer(tok)
    assert pieces.split is None
    assert pieces(TEXTS) == plain(tok, TEXTS)


def test_special_tokens_encoded_as_text_get_whole_texts():
    tok = bpe()
    tok.encode_special_tokens = True
    pieces = PieceTokenizer(tok)
    assert pieces.split is None
    assert pieces(TEXTS) == plain(tok, TEXTS)


def test_word_by_word_gives_exactly_the_tokenizers_ids_batch_after_batch():
    tok = bpe()
    encode = word_encoder(tok)
    assert isinstance(encode, WordEncoder)
    for _ in range(3):  # later batches take every word from the memo
        assert encode(WORD_TEXTS + WHOLE) == plain(tok, WORD_TEXTS + WHOLE)
    assert {" capital", " Paris", " русский", "！", " 🙂", "\n"} <= set(encode.memo)
    assert encode.memo[" capital"] == tuple(plain(tok, [" capital"])[0])


def test_texts_with_characters_outside_the_checked_ranges_go_to_the_tokenizer_whole():
    tok = bpe()
    encode = word_encoder(tok)
    assert all(encode.whole(text) for text in WHOLE)
    assert not any(encode.whole(text) for text in WORD_TEXTS)
    assert encode(WHOLE) == plain(tok, WHOLE)
    assert encode.memo == {}


def test_every_checked_character_is_split_as_the_installed_tokenizer_splits_it():
    # PROBED is compared when an encoder is built; this covers STABLE too (about 14,000 characters).
    assert classes_agree(bpe(), regex.compile(GPT2_SPLIT), CHECKED)


def test_the_probe_sees_a_character_class_that_differs():
    tok = bpe()
    numbers_as_digits = regex.compile(GPT2_SPLIT.replace(r"\p{N}", r"\p{Nd}"))  # ², Ⅻ, ① are numbers
    ascii_spaces = regex.compile(GPT2_SPLIT.replace(r"\s", r"[ \t\n\r\f\v]"))  # U+00A0, U+3000 are spaces
    assert not classes_agree(tok, numbers_as_digits, [(0x00B0, 0x00BF)])
    assert not classes_agree(tok, numbers_as_digits, [(0x2160, 0x216F)])
    assert not classes_agree(tok, ascii_spaces, [(0x3000, 0x3000)])
    assert classes_agree(tok, numbers_as_digits, [(0x0041, 0x007A)])  # no such character in plain Latin


def test_tokenizers_it_would_not_match_exactly_get_no_word_encoder():
    normalised = bpe()
    normalised.normalizer = normalizers.NFKC()
    prefix_space = bpe()
    prefix_space.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    no_regex = bpe()
    no_regex.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    truncated = bpe()
    truncated.enable_truncation(16)
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    newline_token = bpe()  # joined words could form it across the newline between them
    newline_token.add_special_tokens(["\n<sep>"])
    dropout = Tokenizer(models.BPE(dropout=0.5))  # its ids vary from call to call: a memo would freeze them
    dropout.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    dropout.train_from_iterator(CORPUS, trainers.BpeTrainer(initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    unknown_newline = Tokenizer(models.BPE(unk_token="<unk>"))  # a newline would be told from no unknown character
    unknown_newline.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    unknown_newline.train_from_iterator(["hello world"] * 5, trainers.BpeTrainer(special_tokens=["<unk>"]))
    no_newline = Tokenizer(models.BPE())
    no_newline.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    no_newline.train_from_iterator(["hello world"] * 5, trainers.BpeTrainer())
    for tok in (
        normalised,
        prefix_space,
        no_regex,
        truncated,
        metaspace,
        newline_token,
        dropout,
        unknown_newline,
        no_newline,
    ):
        assert word_encoder(tok) is None


def test_long_words_are_not_remembered_and_the_memo_is_bounded(monkeypatch):
    tok = bpe()
    encode = word_encoder(tok)
    long_word = "a" * (words.MEMO_CHARS + 1)
    assert encode([f"x {long_word} y"]) == plain(tok, [f"x {long_word} y"])
    assert set(encode.memo) == {"x", " y"}
    monkeypatch.setattr(words, "MEMO_WORDS", 10)
    texts = [" ".join(f"w{i}" for i in range(k, k + 8)) for k in range(0, 40, 8)]
    assert encode(texts) == plain(tok, texts)
    assert len(encode.memo) <= 10


def test_piece_tokenizer_encodes_its_pieces_word_by_word_for_a_byte_level_bpe():
    tok = bpe()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    texts = [
        f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n{t[::-1]}<|im_end|>\n" for t in WORD_TEXTS + WHOLE
    ]
    pieces = PieceTokenizer(tok)
    assert isinstance(pieces.encode_pieces, WordEncoder)
    assert pieces(texts) == plain(tok, texts)
