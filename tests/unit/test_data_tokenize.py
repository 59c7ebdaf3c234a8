import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from raylora.data.tokenize import PieceTokenizer

CORPUS = [
    "You are a helpful assistant. Answer the question in one sentence, please.",
    "The capital of France is Paris; the capital of Japan is Tokyo.",
    "def add(a, b):\n    return a + b\n\n\n",
    "天气很好，我们去公园散步吧。 Emoji 🙂 too.",
] * 20
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


def bpe(**added_options) -> Tokenizer:
    """A byte-level BPE with merges and the GPT-2 pre-tokenizer regex, trained offline on a small corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
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
