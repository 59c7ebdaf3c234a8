import regex
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from raylora.data import words
from raylora.data.tokenize import PieceTokenizer
from raylora.data.words import CHECKED, GPT2_SPLIT, WordEncoder, classes_agree, word_encoder

CORPUS = [
    "You are a helpful assistant. Answer the question in one sentence, please.",
    "The capital of France is Paris; the capital of Japan is Tokyo. It's 42°C, isn't it? I'll see.",
    "def add(a, b):\n    return a + b\n\n\n\t\tx = [1, 2, 3]  # done   \n",
    "Emoji 🙂 too. Full width！１２３　ＡＢＣ「quoted」、done。",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, 한국어 → ✓ ½ ² Ⅻ €5",
    "天气很好，我们去公园散步吧。こんにちは、カタカナ。ภาษาไทย",
] * 20
TEXTS = [
    *CORPUS[:5],
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
    CORPUS[5],
    "English with one 字 in it",
    "Armenian Ա and new letters \ua7ce\u0558",
    "old italic \U00010300 x",
    "mahjong \U0001f000",
]


def bpe() -> Tokenizer:
    """A byte-level BPE with GPT-2's pre-tokenizer, trained offline on a small multilingual corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    return tok


def plain(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def test_word_by_word_gives_exactly_the_tokenizers_ids_batch_after_batch():
    tok = bpe()
    encode = word_encoder(tok)
    assert isinstance(encode, WordEncoder)
    for _ in range(3):  # later batches take every word from the memo
        assert encode(TEXTS + WHOLE) == plain(tok, TEXTS + WHOLE)
    assert {" capital", " Paris", " русский", "！", " 🙂", "\n"} <= set(encode.memo)
    assert encode.memo[" capital"] == tuple(plain(tok, [" capital"])[0])


def test_texts_with_characters_outside_the_checked_ranges_go_to_the_tokenizer_whole():
    tok = bpe()
    encode = word_encoder(tok)
    assert all(encode.whole(text) for text in WHOLE)
    assert not any(encode.whole(text) for text in TEXTS)
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
    for tok in (normalised, prefix_space, no_regex, truncated, metaspace, newline_token):
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
    texts = [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n{t[::-1]}<|im_end|>\n" for t in TEXTS + WHOLE]
    pieces = PieceTokenizer(tok)
    assert isinstance(pieces.encode_pieces, WordEncoder)
    assert pieces(texts) == plain(tok, texts)
