"""Byte-level BPE word by word: split text as the tokenizer does, take each distinct word's ids once.

A byte-level BPE tokenizer whose pre-tokenizer is GPT-2's ByteLevel alone (SmolLM2, GPT-2) cuts text into words with
one regular expression and encodes every word alone. On text in scripts written with spaces, most of its time
goes to that cut and its offset bookkeeping, not to BPE: splitting with the same expression here (the ``regex``
module), then taking each word's ids from a memo, or from the tokenizer for words not seen yet, gives the same
ids faster (``bench/words.py``).

A text goes to the tokenizer whole when it holds a character outside :data:`CHECKED`:
- scripts written without spaces (Chinese, Japanese, Thai): their words are long runs, rarely repeated, where
  BPE itself is the cost and a split here only adds to it;
- characters assigned in recent Unicode versions, where the two regex engines may put a character in different
  classes (letter, number, whitespace, other). Within CHECKED, every character's class is compared with the
  tokenizer's own pre-tokenizer when the encoder is built (:data:`PROBED`), or has not changed since Unicode 2.0
  (:data:`STABLE`: Hangul syllables are letters, pictographs and emoji symbols).
"""

from __future__ import annotations

import itertools

import numpy as np
import regex
from tokenizers import pre_tokenizers

# ByteLevel(use_regex=True) in Hugging Face tokenizers splits with exactly this expression.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Latin, IPA, Greek, Cyrillic, Hebrew, Arabic, Devanagari, general punctuation, currency, letter-like symbols,
# number forms, arrows, mathematical and technical symbols, CJK punctuation, full-width forms.
PROBED = (
    (0x0000, 0x052F),
    (0x0590, 0x06FF),
    (0x0900, 0x097F),
    (0x1E00, 0x1FFF),
    (0x2000, 0x206F),
    (0x20A0, 0x2BFF),
    (0x3000, 0x303F),
    (0xFF00, 0xFFEF),
)
STABLE = ((0xAC00, 0xD7A3), (0x1F300, 0x1FAFF))
CHECKED = PROBED + STABLE
MEMO_WORDS = 1 << 16  # the memo is emptied when it grows past this many words
MEMO_CHARS = 64  # longest word remembered


class WordEncoder:
    """``encode(texts)`` gives ``backend.encode_batch_fast(texts, add_special_tokens=False)``'s ids, word by word.

    Build it with :func:`word_encoder`, which checks that the tokenizer is one it handles. Texts must hold no
    added token (:class:`~raylora.data.tokenize.PieceTokenizer` splits them off first).
    """

    def __init__(self, backend, split: regex.Pattern, newline: int):
        self.backend = backend
        self.findall = split.findall
        ranges = "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in CHECKED)
        self.whole = regex.compile(f"[^{ranges}]").search
        # A word with no whitespace but an optional leading space: joined to others by newlines, it stays one
        # word, since the expression always cuts between whitespace and anything else.
        self.joinable = regex.compile(r" ?\S+").fullmatch
        self.newline = newline
        self.memo: dict[str, tuple[int, ...]] = {}

    def __call__(self, texts: list[str]) -> list[list[int]]:
        memo = self.memo
        words = [None if self.whole(text) else self.findall(text) for text in texts]
        new = list({w for ws in words if ws is not None for w in ws if w not in memo})
        memo.update(self._encode_words(new))
        whole = iter(encode_ids(self.backend, [text for text, ws in zip(texts, words, strict=True) if ws is None]))
        lookup = memo.__getitem__
        out = [next(whole) if ws is None else list(itertools.chain.from_iterable(map(lookup, ws))) for ws in words]
        # keep the words that may recur: not long ones (mostly unique); past MEMO_WORDS after a batch, start again
        for w in new:
            if len(w) > MEMO_CHARS:
                del memo[w]
        if len(memo) > MEMO_WORDS:
            memo.clear()
        return out

    def _encode_words(self, words: list[str]) -> dict[str, tuple[int, ...]]:
        """Each word's ids. Joinable words go to the tokenizer as one text, one word a line: a text per word
        costs the tokenizer about four times as much. The newline tokens between them mark where each ends."""
        joined: list[str] = []
        alone: list[str] = []
        for w in words:
            (joined if self.joinable(w) else alone).append(w)
        out = dict(zip(alone, map(tuple, encode_ids(self.backend, alone)), strict=True))
        if joined:
            ids = encode_ids(self.backend, ["\n".join(joined)])[0]
            ends = np.flatnonzero(np.asarray(ids) == self.newline).tolist()
            if len(ends) != len(joined) - 1:  # word_encoder's checks rule this out
                raise RuntimeError("words joined by newlines did not stay apart: ids would be wrong")
            starts = [0, *(e + 1 for e in ends)]
            out.update((w, tuple(ids[a:b])) for w, a, b in zip(joined, starts, [*ends, len(ids)], strict=True))
        return out


def encode_ids(backend, texts: list[str]) -> list[list[int]]:
    """The ids of each text: the Rust tokenizer directly, without offsets (a third faster than transformers' wrapper)."""
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)] if texts else []


def word_encoder(backend) -> WordEncoder | None:
    """A :class:`WordEncoder` for ``backend`` (a ``tokenizers.Tokenizer``), or None where it would not be exact.

    It must be a byte-level tokenizer that splits with GPT-2's expression: no normaliser (it would change the
    text before the split), no prefix space, no truncation or padding (they apply to whole texts), no BPE dropout
    (its ids vary from call to call), a newline that is one known token and no added token holding a newline
    (joined words must stay apart). A word alone then splits into itself, so the tokenizer's
    ids of a word alone are its ids in any text.
    """
    pre = backend.pre_tokenizer
    if (
        backend.normalizer is not None
        or not isinstance(pre, pre_tokenizers.ByteLevel)
        or pre.add_prefix_space
        or not pre.use_regex
        or backend.truncation is not None
        or backend.padding is not None
        or getattr(backend.model, "dropout", None)
        or any("\n" in t.content for t in backend.get_added_tokens_decoder().values())
    ):
        return None
    newline = _newline_id(backend)
    split = regex.compile(GPT2_SPLIT)
    if newline is None or not classes_agree(backend, split):
        return None
    return WordEncoder(backend, split, newline)


def _newline_id(backend) -> int | None:
    """The newline's id if it is a token of its own, told apart from every other (joined words are cut at it)."""
    ids = encode_ids(backend, ["\n"])[0]
    unknown = getattr(backend.model, "unk_token", None)
    return ids[0] if len(ids) == 1 and (unknown is None or ids[0] != backend.token_to_id(unknown)) else None


def classes_agree(backend, split: regex.Pattern, ranges=PROBED) -> bool:
    """Whether ``split`` cuts text made of the characters in ``ranges`` exactly where the tokenizer does.

    Each character follows a letter, a digit and a punctuation mark, on a line of its own: whether it is a
    letter, a number, whitespace or other decides which of the three it joins, and lines are cut apart.
    """
    probe = "".join(f"a{c}1{c}!{c}\n" for a, b in ranges for c in map(chr, range(a, b + 1)))
    theirs = [span for _, span in backend.pre_tokenizer.pre_tokenize_str(probe)]
    return [m.span() for m in split.finditer(probe)] == theirs
